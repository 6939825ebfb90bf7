"""Sweeps: the policy_sweep preset and launchers compose, a real multirun through the CLI (one job made to run
out of memory) keeps every cell, and the report, HParams, custom-scalars layout and progress lines read back."""

from __future__ import annotations

import csv
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from callbacks.sweep_progress import SweepProgress, count_basic_sweep, sweep_position
from callbacks.tb_logger import tb_layout, write_tb_layout
from tests.conftest import CONF, SMALL, run_cli
from trainer.errors import ConfigError
from trainer.report import build_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _experiment_in_defaults() -> bool:
    defaults = yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]
    return any(isinstance(d, dict) and "experiment" in d for d in defaults)


# `experiment=policy_sweep` once conf/config.yaml lists `- experiment: null`; `+experiment=...` until then.
EXPERIMENT = ("" if _experiment_in_defaults() else "+") + "experiment=policy_sweep"
# SMALL less batch_size (the `micro` key sets it with accum); ≤ 6 steps; no checkpoints.
TINY = [o for o in SMALL if not o.startswith("batch_size=")] + ["trainer.max_steps=4"]


def compose_hydra(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


# --- the preset and the launchers compose -------------------------------------------------------------------------
def test_policy_sweep_preset_sweeps_policies_and_splits_at_a_fixed_batch() -> None:
    cfg = compose_hydra(EXPERIMENT)
    params = dict(cfg.hydra.sweeper.params)
    assert set(params) == {"policy", "micro"}
    assert params["policy"].split(",")[0] == "none"  # the baseline every ratio needs
    assert count_basic_sweep(params, [EXPERIMENT]) == 15
    assert cfg.batch_size * cfg.accum == 8
    assert "experiment" in cfg.hydra.job.config.override_dirname.exclude_keys
    assert str(cfg.hydra.sweep.dir).startswith("runs/sweeps/policy_sweep_")
    assert cfg.trainer.max_steps <= 50 and cfg.model.n_layer == 4  # CPU-sized


@pytest.mark.parametrize("preset", ["policy_sweep", "policy_sweep_gpu"])
@pytest.mark.parametrize("micro", ["8x1", "2x4"])
def test_presets_pass_the_schema(compose_cfg, preset: str, micro: str) -> None:
    from trainer.core.schema import validate

    config = validate(compose_cfg(EXPERIMENT.replace("policy_sweep", preset), f"micro={micro}", small=False))
    assert config.batch_size * config.accum == 8 and config.seq_len <= config.model.block_size


def test_gpu_preset_is_the_same_sweep_at_gpt2_scale() -> None:
    cfg = compose_hydra(EXPERIMENT.replace("policy_sweep", "policy_sweep_gpu"))
    params = dict(cfg.hydra.sweeper.params)
    assert count_basic_sweep(params, []) == 21 and params["micro"] == "8x1,4x2,2x4"
    assert (cfg.model.name, cfg.model.n_layer, cfg.model.n_embd, cfg.seq_len) == ("gpt2", 12, 768, 1024)
    assert cfg.trainer.accelerator == "gpu" and cfg.batch_size * cfg.accum == 8
    assert str(cfg.hydra.sweep.dir).startswith("runs/sweeps/policy_sweep_gpu_")


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "micro").glob("*.yaml")))
def test_every_micro_option_keeps_the_effective_batch(option: str) -> None:
    cfg = compose_hydra(EXPERIMENT, f"micro={option}")
    b, a = (int(x) for x in option.split("x"))
    assert (cfg.batch_size, cfg.accum) == (b, a)
    assert b * a == 8


def test_command_line_sweep_keys_replace_the_presets() -> None:
    params = {"policy": "none,selective,op_sac,first_k,full", "micro": "8x1,4x2,2x4"}
    assert count_basic_sweep(params, [EXPERIMENT, "policy=none,full", "seq_len=32"]) == 6
    assert count_basic_sweep(params, [EXPERIMENT, "policy=none,full", "micro=8x1"]) == 2
    assert count_basic_sweep({}, ["policy=glob(*)"]) is None  # needs the config loader: no total, no crash


def test_parallel_launcher_composes() -> None:
    launcher = compose_hydra(EXPERIMENT, "hydra/launcher=parallel").hydra.launcher
    assert launcher._target_.endswith("JoblibLauncher") and launcher.n_jobs == 2


def test_slurm_launcher_composes_into_an_sbatch_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No cluster here: compose the config, hand it to submitit as the launcher does, and read the sbatch file."""
    import submitit
    from hydra.core.hydra_config import HydraConfig
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    cfg = compose_hydra(
        EXPERIMENT, "hydra/launcher=slurm", "hydra.launcher.partition=gpu", f"hydra.sweep.dir={tmp_path}"
    )
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit only checks that srun exists
    (fake / "srun").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    HydraConfig.instance().set_config(cfg)
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert isinstance(params, dict)
    params.pop("_target_")
    executor = submitit.AutoExecutor(
        cluster="slurm", folder=params.pop("submitit_folder"), slurm_max_num_timeout=params.pop("max_num_timeout")
    )
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})  # refuses typos
    sbatch = executor._executor._make_submission_file_text("python -u -m submitit.core._submit x", "uid")
    for line in ("--partition=gpu", "--gpus-per-node=1", "--ntasks-per-node=1", "--time=60", "--cpus-per-task=8"):
        assert f"#SBATCH {line}" in sbatch, line
    assert f"--output={tmp_path}/.submitit/" in sbatch


# --- custom scalars and progress, in-process -----------------------------------------------------------------------
def read_layout(tb_dir: Path) -> dict[str, dict[str, list[str]]]:
    from tensorboard.plugins.custom_scalar import layout_pb2

    acc = EventAccumulator(str(tb_dir), size_guidance={"tensors": 0})
    acc.Reload()
    proto = acc.Tensors("custom_scalars__config__")[-1].tensor_proto
    layout = layout_pb2.Layout.FromString(proto.string_val[0])
    return {c.title: {ch.title: list(ch.multiline.tag) for ch in c.chart} for c in layout.category}


def test_custom_scalars_layout_groups_memory_and_time(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    write_tb_layout(writer)  # device not given: every chart, the CUDA ones too
    writer.close()
    layout = read_layout(tmp_path)
    assert set(layout) == {"memory", "time", "loss", "optimizer"}
    memory_tags = {t for tags in layout["memory"].values() for t in tags}
    assert {"^memory/activation_peak_mib$", "^memory/peak_allocated_mib$"} <= memory_tags  # exact-match regexes
    assert {t for tags in layout["time"].values() for t in tags} == {"^time/step_ms$", "^throughput/tokens_per_s$"}
    assert layout == {c: {t: tags for t, (_, tags) in charts.items()} for c, charts in tb_layout().items()}
    write_tb_layout(object())  # anything without add_custom_scalars is left alone


def test_progress_line_says_job_i_of_n() -> None:
    assert sweep_position() is None  # not in a Hydra job
    p = SweepProgress(3, 15, "micro=4x2,policy=full")
    assert p.line(40, 150) == "job 3/15 step 40/150"
    assert SweepProgress(3, None).line(5, 10) == "job 3 step 5/10"


def test_progress_callback_logs_steps_in_a_run(tmp_path: Path, compose_cfg, caplog: pytest.LogCaptureFixture) -> None:
    from trainer.core.run import train

    cfg = compose_cfg("trainer.max_steps=4", "accum=2", "trainer.enable_checkpointing=false")
    with caplog.at_level("INFO", logger="callbacks.sweep_progress"):
        train(cfg, tmp_path, callbacks=[SweepProgress(2, 6, "policy=none", every_n_steps=2)])
    lines = [r.getMessage() for r in caplog.records if r.name == "callbacks.sweep_progress"]
    assert lines == [
        "job 2/6 (policy=none): training for 4 steps",
        "job 2/6 step 2/4",
        "job 2/6 step 4/4",
        "job 2/6 done at step 4",
    ]


# --- a real sweep through the CLI ----------------------------------------------------------------------------------
def multirun(*args: str) -> tuple[int, str]:
    """train.py -m …, one thread per process (the 2 cores are shared; also 10x faster when they are busy)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        r = run_cli("-m", *args, timeout=240)
    return r.returncode, r.stdout + r.stderr


def session_hparams(job: Path) -> dict[str, object]:
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(job), size_guidance={"scalars": 0, "tensors": 0})  # events in the job folder
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: (v.string_value or v.number_value) for k, v in info.hparams.items()}


@pytest.fixture(scope="module")
def completed_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The preset, shrunk: policy none,full × micro 8x1,2x4 = 4 jobs."""
    sweep = tmp_path_factory.mktemp("sweep") / "policy_sweep"
    rc, out = multirun(EXPERIMENT, "policy=none,full", "micro=8x1,2x4", *TINY, f"hydra.sweep.dir={sweep}")
    assert rc == 0, out[-3000:]
    return sweep, out


@pytest.mark.slow
def test_sweep_jobs_land_with_their_hparams(completed_sweep: tuple[Path, str]) -> None:
    sweep, _ = completed_sweep
    jobs = sorted(p.parent for p in sweep.glob("*/summary.json"))
    assert [j.name.split("_")[0] for j in jobs] == ["0", "1", "2", "3"]
    seen = set()
    for job in jobs:
        summary = json.loads((job / "summary.json").read_text())
        assert summary["status"] == "completed"
        assert summary["batch_size"] * summary["accum"] == 8
        hp = session_hparams(job)  # the sweep is one table in TensorBoard's HParams tab
        assert (hp["policy"], hp["batch_size"], hp["accum"]) == (
            summary["policy"],
            summary["batch_size"],
            summary["accum"],
        )
        assert hp["precision"] == summary["precision"] and hp["model"] == summary["model"]["name"]
        seen.add((hp["policy"], hp["batch_size"]))
    assert seen == {("none", 8), ("none", 2), ("full", 8), ("full", 2)}


@pytest.mark.slow
def test_report_of_a_real_sweep_has_every_number(completed_sweep: tuple[Path, str]) -> None:
    from matplotlib import image

    sweep, _ = completed_sweep
    report = build_report(sweep, budget=1e6)
    assert [j.status for j in report.jobs] == ["completed"] * 4
    assert [j.policy for j in report.jobs] == ["none", "none", "full", "full"]
    for j in report.jobs:
        for key in ("activation_peak_mib", "median_step_ms", "tokens_per_s", "final_train_loss", "final_val_loss"):
            assert isinstance(j.get(key), float) and j.get(key) > 0, (j.name, key)  # type: ignore[operator]
        assert j.baseline_exact and j.mem_ratio is not None and j.time_ratio is not None
        assert j.get("steps") == 4
    full = [j for j in report.jobs if j.policy == "full"]
    assert all(j.mem_ratio < 1 for j in full)  # type: ignore[operator]  # recompute stores less
    assert report.pareto_points == 4 and report.loss_lines >= 4
    assert report.budget is not None and "Best within" in report.budget
    for name in ("pareto.png", "loss_curves.png"):
        assert report.paths[name].read_bytes().startswith(PNG_SIGNATURE)
        assert image.imread(report.paths[name]).ndim == 3
    with report.paths["report.csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and all(float(r["tokens_per_s"]) > 0 for r in rows)
    table = [line for line in report.markdown.splitlines() if line.startswith("| ") and "completed" in line]
    assert len(table) == 4


@pytest.mark.slow
def test_sweep_size_is_read_from_the_sweeps_multirun_yaml(completed_sweep: tuple[Path, str]) -> None:
    from callbacks.sweep_progress import sweep_size

    sweep, _ = completed_sweep
    hydra_cfg = OmegaConf.load(sweep / "multirun.yaml").hydra  # as a job sees it: same sweep dir and sweeper
    assert sweep_size(hydra_cfg) == 4


@pytest.mark.slow
def test_sweep_console_says_job_i_of_n(completed_sweep: tuple[Path, str]) -> None:
    _, out = completed_sweep
    assert "job 1/4" in out and "job 4/4 step 4/4" in out


@pytest.mark.slow
def test_sweep_jobs_carry_the_custom_scalars_layout(completed_sweep: tuple[Path, str]) -> None:
    sweep, _ = completed_sweep
    jobs = [p.parent for p in sweep.glob("*/summary.json")]
    assert len(jobs) == 4
    for job in jobs:
        assert "memory" in read_layout(job)


# One job of four runs out of host memory. The basic sweeper makes Cartesian products, so the cells come from a
# test-only config group (on hydra.searchpath) that sets policy, shapes and the limit together. The OOM cell's
# first forward needs several GiB (2048 sequences, 8 heads: T×T scores) against a 3 GiB cap on the data segment,
# while the process holds ~1.4 GiB when a job starts: the cap is hit whatever this machine's exact baseline.
CELLS = {
    "none": {"policy": "none", "batch_size": 8},
    "oom": {
        "policy": "none",
        "batch_size": 2048,
        "seq_len": 64,
        "model": {"n_layer": 4, "n_head": 8, "n_embd": 128},
        "data": {"val_fraction": 0.3},  # one validation batch of 2048 × 65 tokens must fit in the split
        "trainer": {"host_memory_limit_mib": 3072},
    },
    "full": {"policy": "full", "batch_size": 8},
    "selective": {"policy": "selective", "batch_size": 2, "accum": 4},
}


def write_cells(root: Path) -> Path:
    group = root / "cell"
    group.mkdir(parents=True)
    for name, cell in CELLS.items():
        body = {k: v for k, v in cell.items() if k != "policy"}
        body.setdefault("seq_len", 32)
        text = "# @package _global_\ndefaults:\n  - override /policy: " + cell["policy"] + "\n  - _self_\n"
        (group / f"{name}.yaml").write_text(text + yaml.safe_dump(body))
    return root


@pytest.mark.slow
def test_sweep_with_an_oom_job_goes_on_and_reports_it(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    small = [o for o in TINY if not o.startswith(("seq_len=", "batch_size="))]
    rc, out = multirun(
        f"hydra.searchpath=[file://{write_cells(tmp_path / 'conf')}]",
        "+cell=none,oom,full,selective",
        *small,
        "trainer.enable_checkpointing=false",
        f"hydra.sweep.dir={sweep}",
    )
    assert rc == 0, out[-3000:]  # the OOM cell did not stop the sweep
    summaries = {p.parent.name.split("_")[0]: json.loads(p.read_text()) for p in sweep.glob("*/summary.json")}
    assert sorted(summaries) == ["0", "1", "2", "3"]
    assert [summaries[k]["status"] for k in "0123"] == ["completed", "oom", "completed", "completed"], {
        k: s.get("error") for k, s in summaries.items()
    }
    assert "allocate" in summaries["1"]["error"] and "\n" not in summaries["1"]["error"]
    jobs = {p.name.split("_")[0]: p for p in sweep.iterdir() if p.is_dir()}
    for k in "023":
        assert session_hparams(jobs[k])["policy"] == summaries[k]["policy"]

    report = build_report(sweep)
    assert [j.status for j in report.jobs] == ["completed", "completed", "completed", "oom"]  # OOM sorted last
    oom = report.jobs[-1]
    assert oom.batch_size == 2048 and oom.error and "allocate" in oom.error
    assert report.pareto_points == 4
    oom_row = r"^\| 1 \| none \| standard \| 2048 \| 1 \| .* \| oom†? \|"
    assert re.search(oom_row, report.markdown, re.M), report.markdown
    assert "## Jobs that did not complete" in report.markdown and "**oom**" in report.markdown
    for j in report.jobs[:3]:
        assert j.get("tokens_per_s") and j.get("activation_peak_mib") and j.get("final_val_loss")
    hp = session_hparams(jobs["1"])  # the OOM job keeps its row in the HParams table
    assert hp["policy"] == "none" and hp["batch_size"] == 2048


@pytest.mark.slow
def test_a_refused_cell_records_error_and_the_sweep_goes_on(tmp_path: Path) -> None:
    """The micro model has 2 blocks, so the policy.k=3 cell is refused; the cells after it still run."""
    sweep = tmp_path / "sweep"
    r = run_cli("-m", *SMALL, "policy=every_k", "policy.k=1,3,2", "trainer.max_steps=2", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 0, r.stderr[-3000:]
    statuses = {p.parent.name.split("_")[0]: json.loads(p.read_text())["status"] for p in sweep.glob("*/summary.json")}
    assert statuses == {"0": "completed", "1": "error", "2": "completed"}
    refused = json.loads(next(sweep.glob("1_*/summary.json")).read_text())
    assert "policy.k=3 must be between 1 and model.n_layer=2" in refused["error"]
    assert "policy.k=3" in next(sweep.glob("1_*/.hydra/overrides.yaml")).read_text()  # the report names the cell


# ---- each job its own GPUs under the local parallel launcher (trainer/core/placement.py) --------------------


def _hold(lock_dir: str, gpus: int, per_job: int, ready: Any, release: Any, out: Any) -> None:
    from trainer.core.placement import claim_gpus

    with claim_gpus(Path(lock_dir), gpus, per_job, timeout_s=30) as ids:
        out.put(ids)
        ready.set()
        release.wait(30)


def test_concurrent_jobs_each_take_their_own_gpus_and_a_third_waits(tmp_path: Path) -> None:
    """Two jobs (processes) on a machine of 4 GPUs, 2 per job, hold [0, 1] and [2, 3]; a third gets nothing while
    both hold theirs, then the freed slot; a 1-GPU job in the same sweep never lands on a held GPU."""
    import multiprocessing

    from trainer.core.placement import claim_gpus

    ctx = multiprocessing.get_context("spawn")
    out, release = ctx.Queue(), ctx.Event()
    held = []
    for _ in range(2):
        ready = ctx.Event()
        p = ctx.Process(target=_hold, args=(str(tmp_path), 4, 2, ready, release, out))
        p.start()
        assert ready.wait(60)
        held.append(p)
    assert sorted(out.get(timeout=5) for _ in range(2)) == [[0, 1], [2, 3]]
    with pytest.raises(TimeoutError), claim_gpus(tmp_path, 4, 2, timeout_s=1):
        pass
    with pytest.raises(TimeoutError), claim_gpus(tmp_path, 4, 1, timeout_s=1):
        pass
    release.set()
    for p in held:
        p.join(30)
    with claim_gpus(tmp_path, 4, 2, timeout_s=5) as ids:
        assert ids == [0, 1]
        with claim_gpus(tmp_path, 4, 1, timeout_s=5) as one:
            assert one == [2]  # GPU 0 and 1 are held by the 2-GPU job


def test_only_the_parallel_launcher_on_several_gpus_places_jobs(tmp_path: Path) -> None:
    from trainer.core.placement import job_gpus

    joblib = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
    with job_gpus(joblib, "auto", 1, tmp_path, gpu_count=4) as ids:
        assert ids == [0]
    for launcher, accelerator, gpus in ((joblib, "cpu", 4), (joblib, "auto", 1), ("BasicLauncher", "auto", 4)):
        with job_gpus(launcher, accelerator, 1, tmp_path, gpu_count=gpus) as ids:
            assert ids is None
    with pytest.raises(ConfigError, match="lower trainer.devices"), job_gpus(joblib, "gpu", 8, tmp_path, 4):
        pass
