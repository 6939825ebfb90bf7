"""precision=auto by hardware, on both kinds of CPU (the capability probe monkeypatched), and what a run records."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import SMALL, run_cli
from trainer import precision
from trainer.core import step
from trainer.core.module import DecoderModule
from trainer.core.run import preflight, train
from trainer.core.schema import validate


@pytest.fixture(params=[True, False], ids=["native-bf16-cpu", "emulated-bf16-cpu"])
def cpu_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    native = bool(request.param)
    why = "this CPU has AVX512-BF16 (torch: AVX512)" if native else "this CPU has no AVX512-BF16 or AMX (torch: AVX2)"
    monkeypatch.setattr(precision, "cpu_bf16_native", lambda: (native, why))
    return native


def test_auto_picks_by_hardware_and_says_why_in_one_line(cpu_kind: bool) -> None:
    chosen, line = precision.resolve("auto", "cpu")
    assert chosen == ("bf16-mixed" if cpu_kind else "32-true")
    assert "\n" not in line and line.startswith(f"precision=auto → {chosen}: this CPU has")
    other = "precision=32-true forces fp32" if cpu_kind else "precision=bf16-mixed forces bf16"
    assert other in line  # how to force the other


def test_an_explicit_precision_is_kept(cpu_kind: bool) -> None:
    assert precision.resolve("bf16-mixed", "cpu")[0] == "bf16-mixed"
    assert precision.resolve("32-true", "cpu")[0] == "32-true"


def test_bf16_on_a_cpu_that_emulates_it_warns_with_the_slowdown(cpu_kind: bool) -> None:
    warning = precision.emulation_warning("bf16-mixed", "cpu")
    if cpu_kind:
        assert warning is None
    else:
        assert warning is not None and "\n" not in warning and "17× slower" in warning and "precision=auto" in warning
    assert precision.emulation_warning("32-true", "cpu") is None


def test_preflight_settles_auto_and_logs_it(
    cpu_kind: bool, compose_cfg: Callable[..., Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = validate(compose_cfg("precision=auto"))
    with caplog.at_level(logging.INFO, logger="trainer.core.run"):
        preflight(config, tmp_path / "run")
    assert config.precision == ("bf16-mixed" if cpu_kind else "32-true")
    said = [r.getMessage() for r in caplog.records if r.name == "trainer.core.run"]
    assert any(m.startswith(f"precision=auto → {config.precision}") for m in said), said


def test_a_run_records_the_precision_it_used(
    monkeypatch: pytest.MonkeyPatch, compose_cfg: Callable[..., Any], tmp_path: Path
) -> None:
    monkeypatch.setattr(precision, "cpu_bf16_native", lambda: (False, "no native bf16"))
    cfg = compose_cfg("precision=auto", "trainer.max_steps=2", "trainer.enable_checkpointing=false")
    summary = train(cfg, tmp_path / "run")
    assert summary["precision"] == "32-true"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["precision"] == "32-true"


@pytest.mark.slow
def test_the_cli_says_which_precision_it_chose(tmp_path: Path) -> None:
    r = run_cli(*SMALL, "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr[-2000:]
    chosen = json.loads((tmp_path / "run" / "summary.json").read_text())["precision"]
    assert chosen in ("bf16-mixed", "32-true")
    assert f"precision=auto → {chosen}: this CPU" in r.stdout + r.stderr


def _fp16_step(init_scale: float) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], float]:
    """One bare_step under Lightning's 16-mixed plugin (its GradScaler, on CPU) from a fixed tiny GPT; returns the
    weights before and after, the gradients the optimizer step saw, and the scale afterwards."""
    torch.manual_seed(0)
    shape = {"family": "gpt", "block_size": 16, "n_layer": 2, "n_embd": 32, "n_head": 2, "dropout": 0.0}
    module = DecoderModule({**shape, "attention": "eager"}, "none", vocab_size=64)
    module.train()
    opt, sched = step.optimizers_of(module)
    plugin = precision.plugin("16-mixed", "cpu")
    plugin.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g))
    before = [p.detach().clone() for p in module.parameters()]
    seen: list[torch.Tensor] = []
    step.bare_step(
        module,
        [batch],
        opt,
        sched,
        plugin,
        before_update=lambda: seen.extend(p.grad.clone() for p in module.parameters()),
    )
    return before, [p.detach() for p in module.parameters()], seen, plugin.scaler.get_scale()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # the skipped step
def test_16_mixed_scales_the_loss_and_skips_a_step_whose_gradients_overflow() -> None:
    """Lightning's 16-mixed runs GradScaler: the backward on the scaled loss, the gradients unscaled before clipping,
    the step skipped on inf and the scale backed off. bare_step (the estimator's and planner's model of it) too."""
    before, after, grads, scale = _fp16_step(init_scale=2.0**8)
    _, _, reference, _ = _fp16_step(init_scale=1.0)  # unscaled: the gradients the optimizer must see
    assert scale == 2.0**8  # no overflow: kept
    for a, b in zip(grads, reference, strict=True):  # equal up to fp16 rounding (unscaled, they'd be 256× too big)
        assert (a - b).norm() <= 2e-3 * b.norm()
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    before, after, grads, scale = _fp16_step(init_scale=2.0**60)  # the fp16 backward overflows
    assert not all(bool(g.isfinite().all()) for g in grads)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # step skipped
    assert scale == 2.0**59  # backed off


def test_fsdp2_bf16_mixed_is_fsdp2s_mixed_precision_policy(compose_cfg: Callable[..., Any]) -> None:
    """Under trainer=fsdp2, bf16-mixed shards fp32 parameters, all-gathers and computes them in bf16 (no autocast),
    and reduces fp32 gradients into fp32 shards, as torchtitan's MixedPrecisionPolicy; autocast stays by name."""
    from trainer.check.compare import _one_rank_mesh
    from trainer.core import build

    config = validate(compose_cfg("model=micro", "trainer=fsdp2", "precision=bf16-mixed"))
    assert precision.lightning_precision("bf16-mixed", config.trainer) == "32-true"  # Lightning does no autocast
    autocast = validate(compose_cfg("model=micro", "trainer=fsdp2", "trainer.mixed_precision=autocast"))
    assert precision.fsdp2_param_dtype("bf16-mixed", autocast.trainer) is None
    assert precision.lightning_precision("bf16-mixed", autocast.trainer) == "bf16-mixed"
    single = validate(compose_cfg("model=micro", "precision=bf16-mixed"))
    assert precision.fsdp2_param_dtype("bf16-mixed", single.trainer) is None  # one device: autocast
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    with _one_rank_mesh("cpu") as mesh:
        module = build.module(config, "none", precision="bf16-mixed")
        module._device_mesh = mesh
        module.configure_model()
        linear = next(m for m in module.model.modules() if isinstance(m, torch.nn.Linear))
        linear.register_forward_hook(lambda m, a, out: seen.append((a[0].dtype, m.weight.dtype)))
        x = torch.randint(0, 64, (2, 16))
        module.loss_of((x, x)).backward()
        shards = {p.dtype for p in module.parameters()}
        grads = {p.grad.dtype for p in module.parameters() if p.grad is not None}
    assert seen == [(torch.bfloat16, torch.bfloat16)] * len(seen) and seen, seen  # bf16 all-gathered, bf16 compute
    assert shards == {torch.float32} and grads == {torch.float32}  # fp32 master shards, fp32 reduced gradients


@pytest.mark.parametrize("tool", ["train", "estimate", "check"])
def test_a_precision_fsdp2s_policy_cannot_run_is_one_line(tmp_path: Path, tool: str) -> None:
    """precision=16-mixed under FSDP2's bf16 policy: one line naming both ways out, nothing written."""
    import subprocess
    import sys

    from tests.conftest import CLI_ENV, ROOT

    args = ["model=micro", "seq_len=32", "trainer=fsdp2", "precision=16-mixed", f"hydra.run.dir={tmp_path / 'run'}"]
    if tool == "train":
        r = run_cli(*args)
    else:
        extra = ["--device", "cuda"] if tool == "estimate" else []
        cmd = [sys.executable, "-m", f"trainer.{tool}", *args[:-1], *extra]
        r = subprocess.run(cmd, cwd=ROOT, env=CLI_ENV, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert "precision=16-mixed under trainer=fsdp2" in lines[0] and "trainer.mixed_precision=autocast" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CUDA estimate on a machine without CUDA")
def test_one_place_settles_a_configuration_for_the_run_and_the_estimate(
    cpu_kind: bool, compose_cfg: Callable[..., Any]
) -> None:
    """build.resolve settles precision once for every entry point: the run's facts and a CPU estimate's are the same
    facts; a CUDA estimate on a machine without CUDA assumes a bf16 GPU and says so; a precision the device cannot
    run is refused in one line whose fix suits the caller."""
    from trainer.core import build
    from trainer.errors import ConfigError

    config = validate(compose_cfg("precision=auto"))
    run, estimate = build.resolve(config), build.resolve(config, "cpu", estimate=True)
    assert run == estimate and run.device == "cpu" and run.world == 1 and run.hf_config is None
    assert run.precision == ("bf16-mixed" if cpu_kind else "32-true") and run.why.startswith("precision=auto → ")
    cuda = build.resolve(config, "cuda", estimate=True)
    assert cuda.precision == "bf16-mixed" and "no CUDA device here to ask" in cuda.why
    half = validate(compose_cfg("precision=16-mixed"))
    with pytest.raises(ConfigError, match="use precision=auto, bf16-mixed or 32-true on CPU"):
        build.resolve(half)
    with pytest.raises(ConfigError, match="estimate it with --device cuda"):
        build.resolve(half, "cpu", estimate=True)
    assert build.resolve(half, "cuda", estimate=True).precision == "16-mixed"
