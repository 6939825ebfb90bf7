"""Reliability: exact resume after SIGKILL, clear refusals, numeric guards, OOM statuses, DDP and FSDP2 on CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from tests.conftest import CLI_ENV, ROOT, SMALL, run_cli
from trainer.core.run import RunFailed, train
from trainer.measure import metrics as M

RESUME = [
    *SMALL,
    "trainer.max_steps=60",
    "trainer.checkpoint_every_n_steps=1",
    "trainer.val_every_n_steps=15",
    "measure.activation_every_n_steps=0",
    "model.dropout=0.1",
]


def step_losses(run_dir: Path) -> dict[int, float]:
    """train/loss by step over every event file in write order; a resumed run's values replace the killed one's."""
    losses: dict[int, float] = {}
    for path in sorted(run_dir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == "train/loss":
                    losses[event.step] = value.tensor.float_val[0] if value.HasField("tensor") else value.simple_value
    return losses


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def kill_after_step(run_dir: Path, step: int, *args: str) -> None:
    """Start a run, SIGKILL it from outside once its checkpoint of `step` (or a later one) exists."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=CLI_ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    try:
        while time.time() < deadline and proc.poll() is None:
            names = [p.stem for p in (run_dir / "checkpoints").glob("step*.ckpt")]
            if any(int(n.removeprefix("step")) >= step for n in names if n.removeprefix("step").isdigit()):
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the run finished before it could be killed; make it longer"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert not (run_dir / "summary.json").exists()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run a killed-and-resumed one must equal, once for every resume policy."""
    reference = tmp_path_factory.mktemp("reference")
    r = run_cli(*RESUME, "policy=none", f"hydra.run.dir={reference}")
    assert r.returncode == 0, r.stderr[-2000:]
    return reference


@pytest.mark.slow
@pytest.mark.parametrize("resume_policy", ["none", "full"])
def test_sigkill_then_resume_equals_an_uninterrupted_run(
    tmp_path: Path, resume_policy: str, uninterrupted: Path
) -> None:
    reference = uninterrupted
    killed = tmp_path / "killed"
    kill_after_step(killed, 5, *RESUME, "policy=none")
    killed_at = max(step_losses(killed))
    assert killed_at < 60
    # Resume in the same folder, here also under another policy: state_dict keys are the same for every policy.
    r = run_cli(*RESUME, f"policy={resume_policy}", f"hydra.run.dir={killed}", "ckpt_path=last")
    assert r.returncode == 0, r.stderr[-2000:]

    want, got = step_losses(reference), step_losses(killed)
    assert sorted(got) == list(range(1, 61)) == sorted(want)
    assert got == want, "no batch skipped or repeated, same dropout masks"
    a, b = final_weights(reference), final_weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"] == "last"


@pytest.mark.slow
def test_truncated_and_foreign_checkpoints_are_one_line(tmp_path: Path, compose_cfg) -> None:
    truncated = tmp_path / "truncated.ckpt"
    good = tmp_path / "good"
    assert train(compose_cfg("trainer.max_steps=2"), good)["status"] == "completed"
    truncated.write_bytes((good / "checkpoints" / "last.ckpt").read_bytes()[:1000])
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    for path, fragment in [
        (truncated, "is not a readable checkpoint"),
        (foreign, "is not a Lightning training"),
        (tmp_path / "missing.ckpt", "no checkpoint at"),
    ]:
        r = run_cli(*SMALL, f"ckpt_path={path}", f"hydra.run.dir={tmp_path / 'run'}")
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and fragment in lines[0], r.stderr[-2000:]


class Poison(Callback):
    """Turns one weight into inf at the start of a chosen step, as a diverging run would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step + 1 == self.step:
            with torch.no_grad():
                pl_module.model.transformer.ln_f.weight[0] = float("inf")


def test_nonfinite_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path: Path, compose_cfg) -> None:
    cfg = compose_cfg("trainer.max_steps=8", "trainer.checkpoint_every_n_steps=1")
    with pytest.raises(RunFailed) as e:
        train(cfg, tmp_path, callbacks=[Poison(step=4)])
    assert "non-finite" in str(e.value) and "at step 4" in str(e.value) and "\n" not in str(e.value)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "error" and summary["steps"] == 3
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 3
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())


def test_nonfinite_skip_leaves_the_weights_untouched(tmp_path: Path, compose_cfg) -> None:
    cfg = compose_cfg("trainer.max_steps=5", "trainer.on_nonfinite=skip", "trainer.enable_checkpointing=false")

    class NanGrad(Callback):
        def on_after_backward(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
            if trainer.global_step + 1 == 3:
                pl_module.model.transformer.wpe.weight.grad.fill_(float("nan"))

    class Snap(Callback):
        before: dict[str, torch.Tensor] = {}
        after: dict[str, torch.Tensor] = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            if trainer.global_step + 1 == 3:
                Snap.before = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            if trainer.global_step + 1 == 4:
                Snap.after = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    summary = train(cfg, tmp_path, callbacks=[NanGrad(), Snap()])
    assert summary["status"] == "completed" and summary["skipped_steps"] == [3]
    assert all(torch.equal(Snap.before[k], Snap.after[k]) for k in Snap.before)


def test_out_of_host_memory_is_status_oom(tmp_path: Path, compose_cfg) -> None:
    from trainer.core.run import _data_segment_bytes

    # 128 MiB over what the process holds now; the first forward of this shape needs several times that.
    limit = _data_segment_bytes() // 2**20 + 128
    cfg = compose_cfg(f"trainer.host_memory_limit_mib={limit}", "model=tiny", "seq_len=256", "batch_size=32")
    with pytest.raises(RunFailed) as e:
        train(cfg, tmp_path)
    assert e.value.status == "oom" and "\n" not in str(e.value)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "oom" and "allocate" in summary["error"] and summary["policy"] == "none"
    x = torch.empty(64 * 2**20, dtype=torch.uint8)  # the cap is lifted again for whatever runs next
    assert x.numel() == 64 * 2**20


@pytest.mark.slow
def test_cli_oom_single_run_is_one_line_exit_1(tmp_path: Path) -> None:
    r = run_cli(
        *SMALL,
        "trainer.host_memory_limit_mib=1200",
        "model=tiny",
        "seq_len=256",
        "batch_size=64",
        f"hydra.run.dir={tmp_path}",
    )
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 1 and len(lines) == 1 and "oom at step 0" in lines[0], r.stderr[-2000:]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "oom"


@pytest.mark.slow
def test_unwritable_output_folder_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    r = run_cli(*SMALL, f"hydra.run.dir={blocker / 'run'}")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "hydra.run.dir" in lines[0], r.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, policy", [("ddp", "full"), ("fsdp2", "sqrt")])
def test_two_cpu_processes(tmp_path: Path, strategy: str, policy: str) -> None:
    """Two ranks train identical parameters; the policy composes with the strategy (under FSDP2, sqrt's groups of
    two layers are one checkpoint each, inside the shards' all-gathers) and trains exactly as `none` does."""
    runs = {}
    for p in ("none", policy):
        run_dir = tmp_path / f"{strategy}-{p}"
        r = run_cli(
            *SMALL,
            f"trainer={strategy}",
            f"policy={p}",
            "trainer.max_steps=4",
            "model.n_layer=4",
            f"hydra.run.dir={run_dir}",
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        runs[p] = json.loads((run_dir / "summary.json").read_text())
    assert runs[policy]["plan"] == ("[0-3]:full" if policy == "full" else "[0-1]:full-group [2-3]:full-group")
    for summary in runs.values():
        ranks = summary["per_rank"]
        assert summary["world_size"] == 2 and [r["rank"] for r in ranks] == [0, 1]
        assert ranks[0]["param_checksum"] == ranks[1]["param_checksum"]  # identical parameters on both ranks
        assert all(r["activation_peak_mib"] > 0 for r in ranks)  # per-rank memory
    assert runs["none"]["final_train_loss"] == runs[policy]["final_train_loss"]  # policies compose with it
    assert runs[policy]["per_rank"][0]["activation_peak_mib"] < runs["none"]["per_rank"][0]["activation_peak_mib"]
    assert len(list(tmp_path.glob("*/summary.json"))) == 2  # written once per run (rank 0)
    if strategy != "fsdp2":
        return
    # The estimator's one rank of FSDP2 (a fake process group): sharded state, all-gather buffers, activations.
    from trainer.core.schema import compose_config
    from trainer.estimate import measure, open_session
    from trainer.policies import build_policy

    for p, summary in runs.items():
        config = compose_config([*SMALL, f"trainer={strategy}", f"policy={p}", "model.n_layer=4"])
        session = open_session(config)
        try:
            est = measure(session, build_policy(config.policy))
        finally:
            session.close()
        for estimated, run in (
            (est.activation_bytes, summary["per_rank"][0]["activation_peak_mib"]),
            (est.peak_bytes, summary["peak_total_mib"]),
        ):
            assert abs(estimated / (run * 2**20) - 1) <= 0.005, (p, estimated, run * 2**20)


FSDP2_FAMILIES = {
    "gpt": ["model=micro"],
    "llama": ["model=llama-tiny", "model.n_embd=64", "model.n_head=4", "model.mlp_hidden=172"],
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FSDP2_FAMILIES))
def test_fsdp2_mixed_precision_runs_as_estimated_to_the_byte(tmp_path: Path, family: str) -> None:
    """precision=bf16-mixed under trainer=fsdp2 is FSDP2's MixedPrecisionPolicy (bf16 parameters for compute and
    all-gathers, fp32 reduce-scatter and shards): on 2 CPU ranks each per-op policy trains as `none` does (the same
    losses and parameters, bitwise), and the estimator's one rank equals rank 0's measured peaks to the byte."""
    from trainer.core.schema import compose_config
    from trainer.estimate import measure, open_session
    from trainer.policies import build_policy

    shape = [*SMALL, *FSDP2_FAMILIES[family], "model.n_layer=4", "trainer=fsdp2", "precision=bf16-mixed"]
    runs = {}
    for p in ("none", "full", "op_sac", "torchtitan_sac"):
        run_dir = tmp_path / p
        run = [*shape, f"policy={p}", "trainer.max_steps=4", "measure.predict=true", f"hydra.run.dir={run_dir}"]
        r = run_cli(*run, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "FSDP2 MixedPrecisionPolicy" in r.stdout + r.stderr  # the start line names it
        runs[p] = summary = json.loads((run_dir / "summary.json").read_text())
        config = compose_config([*shape, f"policy={p}"])
        session = open_session(config)
        try:
            est = measure(session, build_policy(config.policy))
        finally:
            session.close()
        assert est.activation_bytes == summary["per_rank"][0]["activation_peak_mib"] * 2**20, p
        # The whole-step peak too: FSDP2's collectives on gloo are settled (trainer/parallel/gloo.py), so the last
        # layer's all-gather output is freed in the root's post-forward on every run, not now and then on gloo's
        # worker thread a few ops later (which once added that layer's gathered bytes to the peak).
        for figure in (summary["peak_total_mib"], summary[M.PREDICTED_PEAK_TOTAL_KEY]):
            assert figure * 2**20 == est.peak_bytes, (p, figure * 2**20, est.peak_bytes)
        # the run's own prediction, made inside the run's process group, is the same estimate
        assert summary.get(M.PREDICTION_NOTE) is None, summary.get(M.PREDICTION_NOTE)
        assert summary[M.PREDICTED_ACTIVATION_PEAK_KEY] * 2**20 == est.activation_bytes, p
    checksums = {p: [r["param_checksum"] for r in s["per_rank"]] for p, s in runs.items()}
    assert len({s["final_train_loss"] for s in runs.values()}) == 1, {p: s["final_train_loss"] for p, s in runs.items()}
    assert len({tuple(c) for c in checksums.values()}) == 1, checksums
    peaks = {p: s["per_rank"][0]["activation_peak_mib"] for p, s in runs.items()}
    assert peaks["full"] < min(peaks["op_sac"], peaks["torchtitan_sac"]) < peaks["none"], peaks


@pytest.mark.slow
def test_a_run_shorter_than_the_tracked_step_reports_null_not_zero(tmp_path: Path) -> None:
    """Per-rank activation peaks that were never measured are null in summary.json, never 0.0."""
    run_dir = tmp_path / "short"
    r = run_cli(
        *SMALL,
        "trainer=ddp",
        "trainer.max_steps=2",
        "measure.activation_every_n_steps=0",
        f"hydra.run.dir={run_dir}",
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["activation_peak_mib"] is None
    assert [r["activation_peak_mib"] for r in summary["per_rank"]] == [None, None]
