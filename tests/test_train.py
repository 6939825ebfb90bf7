"""End-to-end: real fits on the embedded corpus through trainer.core.run.train and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import SMALL, run_cli
from trainer.core.run import train
from trainer.measure import metrics

STEP_TAGS = {
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "time/step_ms",
    "throughput/tokens_per_s",
    "memory/activation_peak_mib",
    "memory/peak_total_mib",
}
CUDA_TAGS = {
    "memory/peak_allocated_mib",
    "memory/peak_reserved_mib",
    "memory/alloc_retries",
    "memory/host_pinned_peak_mib",
}
SUMMARY_KEYS = {
    "status",
    "policy",
    "accum",
    "precision",
    "model",
    "batch_size",
    "seq_len",
    "median_step_ms",
    "tokens_per_s",
    "peak_allocated_mib",
    "activation_peak_mib",
    "peak_total_mib",
    "final_train_loss",
    "final_val_loss",
}


def events(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})  # events in the run folder
    acc.Reload()
    return acc


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One short real fit, shared by the read-back tests below."""
    from hydra import compose, initialize_config_dir

    from tests.conftest import CONF

    run_dir = tmp_path_factory.mktemp("run")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                *SMALL,
                "trainer.max_steps=30",
                "trainer.val_every_n_steps=10",
                "optim.warmup_steps=5",
                "optim.lr=3e-3",
                "policy=selective",
            ],
        )
    return run_dir, train(cfg, run_dir)


def test_fit_trains_the_loss_down(fitted: tuple[Path, dict]) -> None:
    run_dir, summary = fitted
    losses = [e.value for e in events(run_dir).Scalars("train/loss")]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses  # bytes start at ln(256) ≈ 5.5
    assert summary["final_val_loss"] < losses[0]


def test_tensorboard_holds_every_tag(fitted: tuple[Path, dict]) -> None:
    run_dir, _ = fitted
    tags = set(events(run_dir).Tags()["scalars"])
    assert STEP_TAGS | {"val/loss", "val/ppl"} <= tags
    if torch.cuda.is_available():
        assert CUDA_TAGS <= tags
    else:
        assert not CUDA_TAGS & tags  # allocator counters exist only on CUDA; activation bytes everywhere


def test_steps_are_logged_once_per_optimizer_step(fitted: tuple[Path, dict]) -> None:
    run_dir, _ = fitted
    steps = [e.step for e in events(run_dir).Scalars("time/step_ms")]
    assert steps == list(range(1, 31))


def test_hparams_are_in_the_events(fitted: tuple[Path, dict]) -> None:
    from tensorboard.plugins.hparams import plugin_data_pb2

    run_dir, summary = fitted
    acc = events(run_dir)
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hp = {k: v for k, v in start.session_start_info.hparams.items()}
    assert hp["policy"].string_value == "selective" and hp["accum"].number_value == 1
    metric = acc.Scalars(metrics.hparam_tag("final_val_loss"))[-1].value
    assert metric == pytest.approx(summary["final_val_loss"], rel=1e-6)


def test_summary_json_is_complete(fitted: tuple[Path, dict]) -> None:
    run_dir, summary = fitted
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(on_disk)
    assert on_disk["status"] == "completed" and on_disk["policy"] == "selective"
    for key in (
        "median_step_ms",
        "tokens_per_s",
        "activation_peak_mib",
        "peak_total_mib",
        "final_train_loss",
        "final_val_loss",
    ):
        assert isinstance(on_disk[key], float) and on_disk[key] > 0, key
    assert on_disk["peak_allocated_mib"] is None  # CPU
    # The whole step's peak holds at least the weights, their gradients and AdamW's two moments (fp32).
    params_mib = on_disk["model"]["params"] * 4 / 2**20
    assert on_disk["peak_total_mib"] > 4 * params_mib + on_disk["activation_peak_mib"] * 0.5
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()


class Capture(Callback):
    """Keeps the trained module and the gradients of the first optimizer step."""

    def __init__(self) -> None:
        self.first_grads: dict[str, torch.Tensor] | None = None
        self.module: torch.nn.Module | None = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
        if self.first_grads is None:
            self.first_grads = {k: p.grad.detach().clone() for k, p in pl_module.named_parameters()}

    def on_train_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        self.module = pl_module


def _fit(tmp_path: Path, compose_cfg, *overrides: str) -> tuple[dict, Capture]:
    capture = Capture()
    summary = train(compose_cfg(*overrides), tmp_path, callbacks=[capture])
    return summary, capture


NO_NOISE = [
    "model.dropout=0.0",
    "precision=32-true",
    "trainer.grad_clip=0",
    "optim.warmup_steps=0",
    "trainer.max_steps=2",
    "trainer.enable_checkpointing=false",
    "data.val_fraction=0.05",
]


def test_accumulation_really_accumulates(tmp_path: Path, compose_cfg) -> None:
    # Two micro-batches of 2 then one step == one batch of 4 then one step: the shuffled order is the same
    # permutation, so the 4-batch is the two 2-batches concatenated and the mean loss is the same objective.
    # Compare the gradients the optimizer receives (Adam's first update is ≈ lr·sign(g), which would amplify
    # float-rounding differences of near-zero gradients).
    _, accum2 = _fit(tmp_path / "a", compose_cfg, *NO_NOISE, "accum=2", "batch_size=2")
    _, batch4 = _fit(tmp_path / "b", compose_cfg, *NO_NOISE, "accum=1", "batch_size=4")
    _, batch2 = _fit(tmp_path / "c", compose_cfg, *NO_NOISE, "accum=1", "batch_size=2")
    a, b, c = accum2.first_grads, batch4.first_grads, batch2.first_grads
    assert a is not None and b is not None and c is not None
    assert all(torch.allclose(a[k], b[k], atol=1e-7, rtol=1e-5) for k in a)
    assert not all(torch.allclose(a[k], c[k], atol=1e-7, rtol=1e-5) for k in a)  # accum is not a no-op
    trainer = accum2.module.trainer  # type: ignore[union-attr]
    assert trainer.global_step == 2 and trainer.fit_loop.total_batch_idx + 1 == 4


def test_none_full_selective_train_identically_with_dropout(tmp_path: Path, compose_cfg) -> None:
    runs = {}
    for policy in ("none", "full", "selective"):
        summary, capture = _fit(
            tmp_path / policy,
            compose_cfg,
            f"policy={policy}",
            "model.dropout=0.2",
            "trainer.max_steps=3",
            "accum=2",
            "trainer.enable_checkpointing=false",
        )
        state = capture.module.state_dict()  # type: ignore[union-attr]
        runs[policy] = (summary["final_train_loss"], {k: v.detach().clone() for k, v in state.items()})
    loss0, state0 = runs["none"]
    for policy in ("full", "selective"):
        loss, state = runs[policy]
        assert loss == loss0, policy
        assert all(torch.equal(state[k], state0[k]) for k in state0), policy


@pytest.mark.slow
def test_cli_multirun_lands_in_one_sweep_folder(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    r = run_cli("-m", "policy=none,full,selective", *SMALL, "trainer.max_steps=4", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 0, r.stderr[-3000:]
    summaries = sorted(sweep.glob("*/summary.json"))
    assert len(summaries) == 3
    policies = {json.loads(p.read_text())["policy"] for p in summaries}
    assert policies == {"none", "full", "selective"}
    assert all(json.loads(p.read_text())["status"] == "completed" for p in summaries)
    assert len({p.parent for p in sweep.glob("*/events.out.tfevents.*")}) == 3  # in each job folder: runs named by job


@pytest.mark.slow
def test_cli_user_command_runs(tmp_path: Path) -> None:
    """The command from the design card, shrunk: selective recompute with 8 micro-batches per step."""
    r = run_cli("policy=selective", "accum=8", *SMALL, "trainer.max_steps=2", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["policy"] == "selective" and summary["accum"] == 8 and summary["tokens_per_step"] == 8 * 4 * 32
    assert summary["plan"].endswith("selective")


@pytest.mark.slow
def test_policies_compose_with_torch_compile(tmp_path: Path) -> None:
    """`trainer.compile=true` compiles the model after the policy: the checkpoint regions go through dynamo."""
    # tests/test_compiled.py's shape (micro, 2 × 32 tokens): where precision=auto is fp32 (no native bf16) the
    # compiled run's graphs are theirs, so on a cold machine inductor's on-disk caches compile them once for the suite;
    # where it is bf16-mixed this is the suite's compiled bf16 run through Lightning
    shape = ["batch_size=2"]
    common = [*SMALL, *shape, "trainer.max_steps=3", "trainer.enable_checkpointing=false", "model.dropout=0.0"]
    eager = run_cli(*common, "policy=none", f"hydra.run.dir={tmp_path / 'eager'}")
    compiled = run_cli(
        *common, "policy=full", "trainer.compile=true", "measure.predict=true", f"hydra.run.dir={tmp_path / 'compiled'}"
    )
    assert eager.returncode == 0 and compiled.returncode == 0, compiled.stderr[-3000:]
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("eager", "compiled"))
    assert b["status"] == "completed" and b["plan"] == "[0-1]:full"
    assert b["final_train_loss"] == pytest.approx(a["final_train_loss"], abs=2e-3)  # inductor reorders float math
    # the compiled run's memory is what its compiled step allocated (the tracker would have run it eagerly), said so
    assert a["memory_counted_by"] == metrics.COUNTED_LIVE_TENSORS
    assert b["memory_counted_by"] == metrics.COUNTED_ALLOCATOR and b["activation_peak_mib"] > 0
    # and the run predicted its compiled step (trainer.measure.fake.compiled),
    # the errors beside what it measured: within
    # 1 % (tests/test_compiled.py: to the byte in fp32 and in bf16, oneDNN's matmul workspaces counted)
    assert b.get(metrics.PREDICTION_NOTE) is None, b.get(metrics.PREDICTION_NOTE)
    assert abs(b["activation_peak_error"]) <= 0.01 and abs(b["peak_total_error"]) <= 0.01, b


def test_a_run_shorter_than_the_warm_up_still_measures(tmp_path: Path, compose_cfg) -> None:
    """A smoke run: 3 steps of 8 micro-batches with the default warm-up of 3 steps. Its last step is
    tracked, every memory figure is there, and the summary says its times include warm-up."""
    cfg = compose_cfg(
        "policy=selective",
        "accum=8",
        "trainer.max_steps=3",
        "measure.warmup_steps=3",
        "measure.activation_every_n_steps=25",
        "trainer.enable_checkpointing=false",
    )
    summary = train(cfg, tmp_path / "run")
    assert summary["steps"] == 3 and summary["time_includes_warmup"] is True
    assert summary["activation_peak_mib"] > 0 and summary["peak_total_mib"] > summary["activation_peak_mib"]
    tagged = [e.step for e in events(tmp_path / "run").Scalars("memory/activation_peak_mib")]
    assert tagged == [3]  # the last step, logged under its global step


def test_times_from_tracked_steps_only_are_flagged() -> None:
    """Warm-up 1, steps 1-3 recorded: when the one step after warm-up was tracked, its (slower) time is the figure
    and the summary says so; once an untracked step follows, the tracked one is left out."""
    from callbacks.measure import MeasureCallback

    def row(step: int, tracked: bool, ms: float) -> dict[str, float]:
        return {
            "step": step,
            "tracked": tracked,
            metrics.STEP_MS: ms,
            metrics.TOKENS_PER_S: 1e3 / ms,
            metrics.TRAIN_LOSS: 1.0,
        }

    cb = MeasureCallback(warmup_steps=1, activation_every_n_steps=2, max_steps=3)
    cb.records = [row(1, False, 100.0), row(2, True, 150.0)]
    s = cb.summary()
    assert s[metrics.MEDIAN_STEP_MS] == 150.0 and s["time_includes_tracked"] is True
    cb.records.append(row(3, False, 110.0))
    s = cb.summary()
    assert s[metrics.MEDIAN_STEP_MS] == 110.0 and s["time_includes_tracked"] is False
