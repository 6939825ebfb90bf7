"""TensorBoard as a user reads a sweep: runs named by the job, Time Series led by what a sweep compares (no `epoch`,
the HParams copies last), the HParams columns a sweep compares ticked, Custom Scalars for the run's device.

Fast tests read a real run's events with TensorBoard's own readers and sorting code; the slow one serves a tiny real
sweep with `tensorboard`, asks its HTTP API what the page shows, and photographs the tabs in headless Chromium
(trainer/report/tensorboard.py; skipped without Chromium)."""

from __future__ import annotations

import math
import re
import struct
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from callbacks.tb_logger import SHOWN_HPARAMS, JobTensorBoardLogger, hparams_summaries, tb_layout, write_tb_layout
from trainer.core.run import HPARAM_METRICS_FIRST
from trainer.measure import metrics as M

# Every per-step tag trainer/measure/metrics.py defines (its str constants with a "/": summary keys have none; the tags
# policy=auto logs once, when it plans, are named in PLAN_TAGS).
STEP_TAGS = {v for k, v in vars(M).items() if k.isupper() and isinstance(v, str) and "/" in v} - set(M.PLAN_TAGS)
TICKED = 5  # TensorBoard's HParams table ticks its first five hparams and its first five metrics


def accumulate(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def read_layout(run_dir: Path) -> dict[str, dict[str, list[str]]]:
    from tensorboard.plugins.custom_scalar import layout_pb2

    proto = accumulate(run_dir).Tensors("custom_scalars__config__")[-1].tensor_proto
    layout = layout_pb2.Layout.FromString(proto.string_val[0])
    return {c.title: {ch.title: list(ch.multiline.tag) for ch in c.chart} for c in layout.category}


def charted(layout: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Each metrics.py tag → how many chart regexes match it, as Custom Scalars matches them (re.match)."""
    regexes = [r for charts in layout.values() for _, tags in charts.values() for r in tags]
    return {t: sum(bool(re.match(r, t)) for r in regexes) for t in STEP_TAGS}


def groups(tags: list[str]) -> list[str]:
    """Time Series card groups in page order (a tag's first component, sorted; the page opens the first two)."""
    return sorted({t.split("/", 1)[0] for t in tags})


# --- Custom Scalars ---------------------------------------------------------------------------------------------------
def test_cuda_layout_charts_every_tag_of_metrics_once() -> None:
    assert STEP_TAGS >= {M.PEAK_TOTAL, M.ACTIVATION_PEAK, *M.CUDA_TAGS, M.VAL_PPL, M.TRAIN_LR}
    assert charted(tb_layout("cuda")) == dict.fromkeys(STEP_TAGS, 1)
    assert tb_layout() == tb_layout("cuda")  # device unknown: every chart


def test_cpu_layout_has_no_cuda_charts_and_a_peak_total_chart() -> None:
    layout = tb_layout("cpu")
    assert charted(layout) == {t: 0 if t in M.CUDA_ONLY_TAGS else 1 for t in STEP_TAGS}
    memory = layout["memory"]
    assert len(memory) == 2 and not any("CUDA" in title for title in memory)
    # each measured peak on one chart with the run's own prediction of it
    assert [r for _, tags in memory.values() for r in tags] == [
        f"^{M.ACTIVATION_PEAK}$",
        f"^{M.PREDICTED_ACTIVATION_PEAK}$",
        f"^{M.PEAK_TOTAL}$",
        f"^{M.PREDICTED_PEAK_TOTAL}$",
    ]
    assert all(tags for charts in layout.values() for _, tags in charts.values())  # no empty chart
    assert not re.match(layout["loss"]["train and val loss"][1][0], M.hparam_tag(M.FINAL_VAL_LOSS))  # exact


def test_layout_reads_back_from_the_events(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    write_tb_layout(writer, "cpu")
    writer.close()
    assert read_layout(tmp_path) == {c: {t: tags for t, (_, tags) in ch.items()} for c, ch in tb_layout("cpu").items()}
    write_tb_layout(object(), "cpu")  # anything without add_custom_scalars is left alone


# --- the logger -------------------------------------------------------------------------------------------------------
def test_logger_writes_into_the_job_folder_without_epoch(tmp_path: Path) -> None:
    logger = JobTensorBoardLogger(tmp_path)
    assert Path(logger.log_dir) == tmp_path
    logger.log_metrics({"epoch": 0, M.VAL_LOSS: 2.5}, step=3)
    logger.log_metrics({"epoch": 1}, step=4)  # nothing left: nothing written
    logger.finalize("success")
    assert accumulate(tmp_path).Tags()["scalars"] == [M.VAL_LOSS]
    assert not (tmp_path / "hparams.yaml").exists()


@pytest.mark.parametrize(("status", "expected"), [("completed", 1), ("oom", 2), ("error", 2), ("interrupted", 0)])
def test_session_status_follows_the_run(status: str, expected: int) -> None:
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    _, _, end = hparams_summaries({"policy": "none", "status": status}, [M.hparam_tag(M.STEPS)], domains={})
    info = plugin_data_pb2.HParamsPluginData.FromString(end.value[0].metadata.plugin_data.content).session_end_info
    assert info.status == expected and api_pb2.Status.Name(info.status).startswith("STATUS_")


# --- a real run -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hydra import compose, initialize_config_dir

    from tests.conftest import CONF, SMALL
    from trainer.core.run import train

    run_dir = tmp_path_factory.mktemp("run")
    overrides = [*SMALL, "trainer.max_steps=4", "trainer.val_every_n_steps=2", "trainer.enable_checkpointing=false"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        train(compose("config", overrides=[*overrides, "accum=2", "policy=full"]), run_dir)
    return run_dir


def experiment(run_dir: Path) -> Any:
    """The run's HParams experiment, sorted and cut the way TensorBoard's backend serves it."""
    from tensorboard.plugins.hparams import backend_context, metadata

    content = accumulate(run_dir).PluginTagToContent("hparams")[metadata.EXPERIMENT_TAG]
    exp = metadata.parse_experiment_plugin_data(content)
    backend_context._sort_and_reduce_to_hparams_limit(exp)
    return exp


def test_events_are_in_the_job_folder_and_read_back(run_dir: Path) -> None:
    from trainer.report import read_scalars

    assert list(run_dir.glob("events.out.tfevents.*")) and not (run_dir / "tb").exists()
    assert [s for s, _ in read_scalars(run_dir)[M.STEP_MS]] == [1, 2, 3, 4]  # the report finds them


def test_time_series_leads_with_what_a_sweep_compares(run_dir: Path) -> None:
    tags = accumulate(run_dir).Tags()["scalars"]
    assert "epoch" not in tags and M.VAL_LOSS in tags
    order = groups(tags)
    assert order[:2] == ["memory", "throughput"], order  # the two groups Time Series opens
    hparam_group = M.hparam_tag("x").split("/", 1)[0]
    assert order[-1] == hparam_group, (
        f"{order}: the HParams copies must sort last (trainer/measure/metrics.py hparam_tag)"
    )


def test_hparams_ticks_the_columns_a_sweep_compares(run_dir: Path) -> None:
    exp = experiment(run_dir)
    ticked = sorted(exp.hparam_infos, key=lambda i: not i.differs)[:TICKED]  # the table's own stable sort
    assert [i.name for i in ticked] == sorted(SHOWN_HPARAMS) == ["loss", "micro", "model", "policy", "precision"]
    assert {i.name for i in exp.hparam_infos} >= {"accum", "batch_size", "status", "seq_len"}  # the rest follow
    assert [m.name.tag for m in exp.metric_infos][:TICKED] == [M.hparam_tag(k) for k in HPARAM_METRICS_FIRST]
    assert [m.display_name for m in exp.metric_infos][:TICKED] == list(HPARAM_METRICS_FIRST)
    policy = next(i for i in exp.hparam_infos if i.name == "policy")
    assert "full" in [v.string_value for v in policy.domain_discrete.values]  # filterable


def test_hparams_session_holds_the_run(run_dir: Path) -> None:
    from tensorboard.plugins.hparams import metadata

    acc = accumulate(run_dir)
    content = acc.PluginTagToContent("hparams")
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
    hp = {k: v.string_value or v.number_value for k, v in start.hparams.items()}
    got = (hp["policy"], hp["micro"], hp["accum"], hp["batch_size"], hp["status"])
    assert got == ("full", "4x2", 2, 4, "completed")
    assert end.status == 1  # STATUS_SUCCESS
    for tag in (m.name.tag for m in experiment(run_dir).metric_infos):
        value = acc.Scalars(tag)[-1].value  # the HParams backend reads a metric as its tag's last scalar
        assert math.isnan(value) if tag == M.hparam_tag(M.PEAK_ALLOCATED_KEY) else value > 0, tag


def test_run_layout_is_for_its_device(run_dir: Path) -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert read_layout(run_dir) == {c: {t: tags for t, (_, tags) in ch.items()} for c, ch in tb_layout(device).items()}


# --- in a browser -----------------------------------------------------------------------------------------------------
def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n"), path
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.mark.slow
def test_a_served_sweep_reads_well_in_a_browser(tmp_path: Path) -> None:
    from matplotlib import image

    from trainer.report import tensorboard as shot

    chromium = shot.find_chromium()
    if chromium is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install -y chromium); trainer.report.tensorboard needs it")
    sweep = shot.tiny_sweep(tmp_path / "sweep")
    jobs = sorted(p.parent.name for p in sweep.glob("*/summary.json"))
    assert jobs == [
        "0_micro=8x1,policy=none",
        "1_micro=2x4,policy=none",
        "2_micro=8x1,policy=full",
        "3_micro=2x4,policy=full",
    ]
    with shot.serving(sweep) as tb:
        seen = shot.describe(tb)
        assert sorted(seen["runs"]) == jobs  # runs named by the job, not <job>/tb
        assert seen["hparams_ticked"] == sorted(SHOWN_HPARAMS)
        assert seen["metrics_ticked"] == list(HPARAM_METRICS_FIRST)
        order = seen["timeseries_groups"]
        assert "epoch" not in order and order[:2] == ["memory", "throughput"], order
        assert order[-1] == M.hparam_tag("x").split("/", 1)[0], order
        assert list(seen["custom_scalars"]) == ["memory", "time", "loss", "optimizer"]
        assert len(seen["custom_scalars"]["memory"]) == 2  # CPU: activation and whole-step peaks, no CUDA charts
        groups_by_name = {g["name"]: g for g in tb.session_groups()}  # one session per group: its job
        assert sorted(groups_by_name) == jobs
        for name, group in groups_by_name.items():
            assert group["hparams"]["policy"] == name.rsplit("=", 1)[1]
            assert [s["status"] for s in group["sessions"]] == ["STATUS_SUCCESS"]
            assert len(group["sessions"][0]["metricValues"]) == len(M.SUMMARY_FIGURES)
        pngs = shot.photograph(tb, tmp_path / "png", chromium)
    assert sorted(pngs) == sorted(shot.TABS)
    for name, png in pngs.items():
        assert png_size(png) == shot.TABS[name][1], name
        pixels = image.imread(png)[..., :3]
        colours = len({tuple(p) for p in pixels[::7, ::7].reshape(-1, 3).round(2).tolist()})
        assert pixels.std() > 0.05 and colours > 30, (name, pixels.std(), colours)  # a drawn page, not a blank one
