"""The estimator held to measurement: activation peaks against the live-tensor tracker, the whole step's peak against
real training runs, FLOPs against FlopCounterMode, and the command line.

Every registered policy is estimated and measured at several tiny shapes that vary T, B, L, n_embd and heads,
dropout 0.1 and 0, eager and SDPA attention (SDPA with dropout takes the CPU math fallback), 32-true, bf16-mixed
and bf16-true. The measurement runs what GPTModule.training_step runs (forward under autocast returning only the
loss, then backward) inside a LiveTensorTracker and takes `peak_bytes_excluding(param grads)`, the figure the
measuring callback logs as memory/activation_peak_mib. Autocast runs as Lightning's precision plugin runs it, with
its weight cache off (the estimator's default); the bf16-mixed shapes are also measured with the cache on, against
the estimator's `autocast_cache=True`.

The whole step: short `trainer.run.train` runs (several policies, accumulation, fp32 and bf16 weights), their
summary's `peak_total_mib` and `activation_peak_mib` against `peak_bytes` and `activation_bytes`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from models.gpt import GPT, GPTConfig
from tests.conftest import ROOT
from trainer.estimate import (
    Estimate,
    Shapes,
    block_inventory,
    buffer_bytes,
    default_policy,
    estimate,
    estimate_all,
    main,
    optimizer_step_bytes,
    parameter_count,
    parse_bytes,
    shapes_of,
)
from trainer.flops import count_flops
from trainer.memory import MIB, LiveTensorTracker
from trainer.policies import POLICIES, PolicyError, apply_policy, build_policy, policy_params
from trainer.run import train
from trainer.schema import Config, validate

TOLERANCE = 0.10  # the contract; observed agreement is far tighter (a few hundred bytes on these shapes)
# The whole step against real runs: observed within ~200 bytes (Lightning's scalars). 2 % still catches the old
# model's errors (every gradient beside the activation peak, no buffers): 4-10 % on these runs at accum=1.
STEP_TOLERANCE = 0.02

# Tiny shapes (model=micro is the base). Each varies several of T, B, L, n_embd, heads.
SHAPES = {
    "eager-dropout-bf16mixed": [
        "model.n_layer=3", "model.n_embd=64", "model.n_head=2", "seq_len=32", "batch_size=2",
        "model.dropout=0.1", "model.attention=eager", "precision=bf16-mixed",
    ],
    "sdpa-nodropout-32true": [
        "model.n_layer=2", "model.n_embd=48", "model.n_head=4", "seq_len=24", "batch_size=3",
        "model.dropout=0.0", "model.attention=sdpa", "precision=32-true",
    ],
    "sdpa-dropout-bf16mixed": [  # CPU math fallback: fp32 T×T probabilities, noise and dropout output are kept
        "model.n_layer=4", "model.n_embd=32", "model.n_head=2", "seq_len=64", "batch_size=1",
        "model.dropout=0.1", "model.attention=sdpa", "precision=bf16-mixed",
    ],
    "eager-nodropout-32true": [
        "model.n_layer=2", "model.n_embd=64", "model.n_head=4", "seq_len=16", "batch_size=4",
        "model.dropout=0.0", "model.attention=eager", "precision=32-true",
    ],
    "eager-dropout-bf16true": [
        "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "seq_len=48", "batch_size=2",
        "model.dropout=0.1", "model.attention=eager", "precision=bf16-true",
    ],
}  # fmt: skip


@pytest.fixture
def config_for(compose_cfg: Callable[..., object]) -> Callable[..., Config]:
    """The composed test config at a shape, with a registered policy at its conf/policy defaults."""

    def _config(shape: str, policy: str = "none", *extra: str) -> Config:
        config = validate(compose_cfg(*SHAPES[shape], *extra))
        if policy != "none" or not any(e.startswith("policy") for e in extra):
            config.policy = policy_params(default_policy(policy))
        return config

    return _config


def runnable(config: Config) -> Config:
    """Skip, naming the reason, a registered policy whose defaults cannot run without more parameters."""
    try:
        build_policy(config.policy).check(config.model.n_layer, config.model.attention)
    except PolicyError as e:
        pytest.skip(f"{config.policy['name']} needs parameters its conf defaults do not give: {e}")
    return config


def _model_and_step(config: Config, cache: bool = False) -> tuple[GPT, Callable[[], torch.Tensor]]:
    """The real model with the configured policy, and one training step's forward (as GPTModule runs it), under
    autocast with its weight cache off as Lightning's precision plugin runs it (`cache`: on, as a bare loop's)."""
    sh, _ = shapes_of(config)
    torch.manual_seed(0)
    values = {f.name: getattr(config.model, f.name) for f in fields(GPTConfig)}
    model = GPT(GPTConfig(**{**values, "vocab_size": sh.vocab}))
    if config.precision == "bf16-true":
        model.to(torch.bfloat16)
    apply_policy(model, config.policy)
    x = torch.randint(0, sh.vocab, (sh.batch, sh.seq))
    y = torch.randint(0, sh.vocab, (sh.batch, sh.seq))

    def autocast() -> torch.autocast | nullcontext[None]:
        if config.precision == "bf16-mixed":
            return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache)
        return nullcontext()

    def forward() -> torch.Tensor:
        with autocast():
            _, loss = model(x, y)  # the logits die here, with the step's frame
        return loss

    return model, forward


def measured_activation_peak(config: Config, cache: bool = False) -> int:
    model, forward = _model_and_step(config, cache)
    with LiveTensorTracker() as tracker:
        forward().backward()
    return tracker.peak_bytes_excluding([p.grad for p in model.parameters()])


# ----------------------------------------------------------------------------------------------------
# Memory: estimate vs the tracker, every policy, every shape.
# ----------------------------------------------------------------------------------------------------


# (shape, autocast cache): every shape as train.py runs it, and the autocast shapes with the cache on too
CASES = [(shape, False) for shape in SHAPES] + [(s, True) for s in SHAPES if "bf16mixed" in s]


@pytest.mark.parametrize("shape, cache", CASES, ids=[s + ("-cache" if c else "") for s, c in CASES])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_activation_peak_matches_the_tracker(
    config_for: Callable[..., Config], shape: str, cache: bool, policy: str
) -> None:
    config = runnable(config_for(shape, policy))
    est = estimate(config, "cpu", autocast_cache=cache)
    measured = measured_activation_peak(config, cache)
    error = est.activation_bytes / measured - 1
    assert abs(error) <= TOLERANCE, (
        f"{policy} at {shape} (autocast cache {'on' if cache else 'off'}): estimated {est.activation_bytes} B, "
        f"measured {measured} B ({100 * error:+.2f} %); estimated peak at {est.peak_at}"
    )


def test_the_comparison_can_fail(config_for: Callable[..., Config]) -> None:
    """The tolerance is not loose: each effect the model adds to the textbook count is worth more than 10 % here.
    Dropping it (or applying the CUDA rules to a CPU run) takes the estimate out of tolerance."""
    cases = [  # (shape, policy, device the rules are taken from, component left out)
        ("sdpa-dropout-bf16mixed", "none", "cuda", None),  # 1-byte masks and fused SDPA instead of the math path
        ("eager-nodropout-32true", "full", "cpu", "recompute_transient"),  # a checkpointed block's recompute
        ("eager-dropout-bf16mixed", "none", "cpu", "autocast_weight_copies"),  # bf16 weight copies
        ("sdpa-nodropout-32true", "none", "cpu", "logits_loss"),  # fp32 logits, log-softmax and their grads
    ]
    for shape, policy, device, left_out in cases:
        config = config_for(shape, policy)
        measured = measured_activation_peak(config)
        est = estimate(config, device)
        wrong = est.activation_bytes - (est.components[left_out] if left_out else 0)
        assert abs(wrong / measured - 1) > TOLERANCE, (shape, policy, device, left_out)
        assert abs(estimate(config, "cpu").activation_bytes / measured - 1) <= TOLERANCE
    # The autocast cache: under `full` it holds every block's weight copies to the end of the forward. Modelling
    # the wrong one of Lightning's (off) and a bare loop's (on) autocast misses by more than the tolerance.
    config = config_for("eager-dropout-bf16mixed", "full")
    for cache in (False, True):
        measured = measured_activation_peak(config, cache)
        assert abs(estimate(config, autocast_cache=cache).activation_bytes / measured - 1) <= TOLERANCE
        assert abs(estimate(config, autocast_cache=not cache).activation_bytes / measured - 1) > TOLERANCE, cache


# ----------------------------------------------------------------------------------------------------
# The whole step: estimate vs real training runs (train.py's summary).
# ----------------------------------------------------------------------------------------------------

RUNS = {  # name: (policy, extra overrides); on conftest's SMALL (model=micro: eager, dropout 0.1, bf16-mixed)
    **{p: (p, ()) for p in POLICIES if p != "auto"},  # auto plans at fit start: tests/test_planner.py
    "full-accum2": ("full", ("accum=2",)),
    "none-accum2": ("none", ("accum=2",)),
    "none-sdpa-32true": ("none", ("model.attention=sdpa", "model.dropout=0.0", "precision=32-true")),
    "sqrt-sdpa-dropout-L4": ("sqrt", ("model.attention=sdpa", "model.n_layer=4")),  # CPU math fallback
    "op_sac-bf16true": ("op_sac", ("precision=bf16-true",)),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_step_peak_matches_a_training_run(compose_cfg: Callable[..., object], tmp_path: Path, run: str) -> None:
    """`peak_bytes` is the whole step's peak as train.py measures it (memory/peak_total_mib: the tracker with the
    training state adopted, in steady state) and `activation_bytes` its memory/activation_peak_mib."""
    policy, extra = RUNS[run]
    cfg = compose_cfg(f"policy={policy}", "trainer.max_steps=3", "trainer.enable_checkpointing=false", *extra)
    est = estimate(validate(cfg), "cpu")
    summary = train(cfg, tmp_path / run)
    assert summary["status"] == "completed"
    total, activation = summary["peak_total_mib"] * MIB, summary["activation_peak_mib"] * MIB
    for what, estimated, measured, tolerance in (
        ("peak_total", est.peak_bytes, total, STEP_TOLERANCE),
        ("activation_peak", est.activation_bytes, activation, TOLERANCE),
    ):
        error = estimated / measured - 1
        assert abs(error) <= tolerance, (
            f"{run}: {what} estimated {estimated} B, measured {measured:.0f} B ({100 * error:+.2f} %); "
            f"step peak estimated at {est.step_peak_at}"
        )


# ----------------------------------------------------------------------------------------------------
# FLOPs: exactly what FlopCounterMode counts on the real model.
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["eager-dropout-bf16mixed", "sdpa-nodropout-32true", "sdpa-dropout-bf16mixed"])
def test_flops_equal_flop_counter_exactly(config_for: Callable[..., Config], shape: str) -> None:
    """Exact integer equality: both count the same matmul and attention ops (mm, addmm, bmm, SDPA) with the same
    formulas, and neither counts elementwise ops. Recompute follows non-reentrant checkpoint's early stop (ops after
    the last saved tensor are not rerun) and SAC's cache (saved matmuls are not rerun)."""
    totals = {}
    for policy in POLICIES:
        config = config_for(shape, policy)
        try:
            est = estimate(config, "cpu")
        except PolicyError:  # needs parameters beyond its conf defaults (reported by the memory test's skip)
            continue
        model, forward = _model_and_step(config)
        assert count_flops(forward) == est.fwd_flops, policy
        total = count_flops(lambda forward=forward: forward().backward())
        assert total == est.fwd_flops + est.bwd_flops + est.recompute_flops, policy
        totals[policy] = (total, est)
    none_total, none_est = totals["none"]
    assert none_est.recompute_flops == 0
    for policy, (total, est) in totals.items():
        assert est.recompute_flops == total - none_total, policy
        assert (est.fwd_flops, est.bwd_flops) == (none_est.fwd_flops, none_est.bwd_flops)


def test_flops_scale_with_accumulation(config_for: Callable[..., Config]) -> None:
    one = estimate(config_for("eager-dropout-bf16mixed", "full"))
    four = estimate(config_for("eager-dropout-bf16mixed", "full", "accum=4"))
    assert (four.fwd_flops, four.bwd_flops, four.recompute_flops) == (
        4 * one.fwd_flops,
        4 * one.bwd_flops,
        4 * one.recompute_flops,
    )
    assert four.activation_bytes == one.activation_bytes  # memory is per micro-batch


# ----------------------------------------------------------------------------------------------------
# The model's pieces: inventories, dtype effects, components, assumptions.
# ----------------------------------------------------------------------------------------------------


def _shapes(**kw: object) -> Shapes:
    base = dict(batch=2, seq=32, n_embd=64, n_head=4, n_layer=2, vocab=256, block_size=32, dropout=0.1)
    return Shapes(**{**base, **kw})  # type: ignore[arg-type]


def test_block_inventories_per_treatment() -> None:
    sh = _shapes(attention="eager", precision="bf16-mixed")
    n, C = sh.tokens, sh.n_embd
    by_name = {t.name.split(".", 1)[1]: t for t in block_inventory(sh, "none")}
    # the residual stream is fp32 under autocast: the block input costs 4 bytes per element, not 2
    assert by_name["x"].dtype == "fp32" and by_name["x"].nbytes == 4 * n * C
    # CPU dropout keeps a scaled noise tensor in the input dtype, not a 1-byte mask
    assert by_name["attn_drop.mask"].dtype == "bf16" and by_name["resid_drop.mask"].dtype == "bf16"
    assert {"softmax", "attn_drop.out", "h", "gelu", "c_fc.w16"} <= set(by_name)
    full = block_inventory(sh, "full")
    assert [t.name for t in full] == ["b0.x"]
    selective = {t.name.split(".", 1)[1] for t in block_inventory(sh, "selective")}
    assert "softmax" not in selective and "attn_drop.mask" not in selective and "qkv" in selective
    sac = {t.name.split(".", 1)[1] for t in block_inventory(sh, "op_sac")}
    assert sac == {"x", "qkv", "attn_out", "h", "mlp_out"}  # the input and the mm/addmm outputs
    cuda = {t.name.split(".", 1)[1]: t for t in block_inventory(_shapes(device="cuda"), "none")}
    assert cuda["attn_drop.mask"].dtype == "bool" and cuda["softmax"].dtype == "fp32"  # softmax is fp32 on CUDA
    assert all(t.nbytes < 1 << 16 for t in block_inventory(_shapes(device="cuda", batch=16), "offload"))


def test_sdpa_kernels_by_device_and_dropout() -> None:
    assert _shapes(attention="sdpa", dropout=0.1).attn_kernel == "math"
    assert _shapes(attention="sdpa", dropout=0.0).attn_kernel == "fused"
    assert _shapes(attention="sdpa", dropout=0.1, device="cuda").attn_kernel == "fused"
    cpu = {t.name.split(".", 1)[1] for t in block_inventory(_shapes(attention="sdpa", dropout=0.0), "none")}
    assert "softmax" not in cpu and {"qkv", "y", "lse"} <= cpu  # no T×T with the fused kernel


def test_components_add_up_and_optimizer_dtype(config_for: Callable[..., Config]) -> None:
    for shape in ("eager-dropout-bf16mixed", "eager-dropout-bf16true"):
        est = estimate(config_for(shape, "selective"))
        c = est.components
        parts = ("autocast_weight_copies", "activations", "recompute_transient", "backward_working_set")
        assert sum(c[k] for k in (*parts, "logits_loss", "tied_grad_buffer")) == est.activation_bytes
        resident = c["parameters"] + c["buffers"] + c["optimizer_state"]
        assert c["total"] == est.peak_bytes == resident + c["step_peak_gradients"] + c["step_peak_in_flight"]
        assert c["step_peak_gradients"] <= c["gradients"]
        # at least the activation peak and the optimizer step; at most every gradient beside the larger of them
        after_backward = c["gradients"] + c["optimizer_step_transient"]
        assert resident + max(est.activation_bytes, after_backward) <= est.peak_bytes
        assert est.peak_bytes <= resident + c["gradients"] + max(est.activation_bytes, c["optimizer_step_transient"])
    sh, _ = shapes_of(config_for("eager-dropout-bf16true"))
    n = parameter_count(sh)
    assert estimate(config_for("eager-dropout-bf16true")).components["optimizer_state"] == 2 * n * 2
    assert (
        estimate(config_for("eager-dropout-bf16mixed")).components["optimizer_state"]
        == 2 * parameter_count(shapes_of(config_for("eager-dropout-bf16mixed"))[0]) * 4
    )


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("shape", ["eager-dropout-bf16mixed", "sdpa-nodropout-32true"])
def test_optimizer_step_temporaries_match_the_tracker(config_for: Callable[..., Config], shape: str, foreach: bool):
    """AdamW.step() with the trainer's param groups: single-tensor (the CPU default) and foreach (CUDA's default;
    the estimate's cuda rule), measured on CPU with the tracker, state already created."""
    from trainer.module import param_groups

    config = config_for(shape)
    model, forward = _model_and_step(config)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, foreach=foreach)
    for _ in range(2):
        forward().backward()
        if not opt.state:
            opt.step()
    with LiveTensorTracker() as tracker:
        opt.step()
    sh, _ = shapes_of(config, "cuda" if foreach else "cpu")
    assert tracker.peak_bytes == optimizer_step_bytes(sh)


def test_parameter_and_buffer_bytes_match_the_model(config_for: Callable[..., Config]) -> None:
    for shape in SHAPES:
        config = config_for(shape)
        model, _ = _model_and_step(config)
        sh = shapes_of(config)[0]
        assert parameter_count(sh) == model.num_parameters()
        assert buffer_bytes(sh) == sum(b.nbytes for b in model.buffers())
        assert estimate(config).components["parameters"] == sum(p.nbytes for p in model.parameters())


def test_vocab_size_assumption(config_for: Callable[..., Config]) -> None:
    sh, notes = shapes_of(config_for("eager-dropout-bf16mixed"))
    assert sh.vocab == 256 and "data.tokenizer=byte" in notes[0]
    sh, notes = shapes_of(config_for("eager-dropout-bf16mixed", "none", "data=wikitext103"))
    assert sh.vocab == 16384 and "bpe_vocab_size" in notes[0]
    sh, notes = shapes_of(config_for("eager-dropout-bf16mixed", "none", "model.vocab_size=1000"))
    assert sh.vocab == 1000 and notes == []


def test_policies_rank_as_the_theory_says(config_for: Callable[..., Config]) -> None:
    table = estimate_all(config_for("eager-dropout-bf16mixed", "none", "model.n_layer=6", "seq_len=64"))
    assert set(table) == set(POLICIES)
    est = {k: v for k, v in table.items() if isinstance(v, Estimate)}
    assert {"none", "full", "selective", "sqrt", "every_k", "first_k", "op_sac", "offload", "per_block"} <= set(est)
    kept = {k: v.kept_bytes for k, v in est.items()}
    assert kept["full"] < kept["op_sac"] < kept["selective"] < kept["none"]
    assert est["full"].recompute_flops > est["op_sac"].recompute_flops > est["selective"].recompute_flops > 0
    assert est["none"].per_block == [est["none"].per_block[0]] * 6


def test_a_policy_that_cannot_run_is_reported(config_for: Callable[..., Config]) -> None:
    table = estimate_all(config_for("eager-dropout-bf16mixed", "none", "model.n_layer=1"))
    assert isinstance(table["every_k"], str) and "policy.k=2" in table["every_k"]
    assert isinstance(table["none"], Estimate)


@pytest.mark.parametrize(
    "text, value",
    [("40GB", 40 * 10**9), ("40GiB", 40 * 2**30), ("40000MiB", 40000 * 2**20), ("1.5tb", 1.5e12), ("123", 123)],
)
def test_parse_budget(text: str, value: float) -> None:
    assert parse_bytes(text) == int(value)


@pytest.mark.parametrize("text", ["40XB", "GB", "-3GB", "0"])
def test_parse_budget_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="--budget"):
        parse_bytes(text)


# ----------------------------------------------------------------------------------------------------
# The command line.
# ----------------------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer.estimate", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_cli_example_prints_table_verdict_and_json(tmp_path) -> None:
    out = tmp_path / "est" / "out.json"
    r = _cli("model=gpt2-medium", "seq_len=1024", "batch_size=8", "policy=full", "--budget", "40GB", "--json", str(out))
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert "| policy | plan | activation peak MiB | total MiB | FLOPs × none | fits 40 GB? |" in text
    for name in POLICIES:
        assert f"\n| {name}" in text
    assert "policy=full fits in 40 GB" in text
    assert "assumption: vocab_size 256" in text
    data = json.loads(out.read_text())
    assert data["policy"] == "full" and data["fits"] is True and data["budget_bytes"] == 40 * 10**9
    assert set(data["all_policies"]) == set(POLICIES)
    e = data["estimate"]
    assert e["peak_bytes"] == e["components"]["total"] and len(e["per_block"]) == 24
    assert e["flops"] == e["fwd_flops"] + e["bwd_flops"] + e["recompute_flops"]


def test_cli_autocast_cache_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """train.py's autocast (weight cache off) by default; --autocast-cache models a bare loop's default autocast."""
    args = ["model=micro", "model.n_layer=4", "model.n_embd=128", "seq_len=8", "batch_size=1", "policy=full"]
    assert main([*args, "--json", str(tmp_path / "off.json")]) == 0
    off = capsys.readouterr().out
    assert main([*args, "--autocast-cache", "--json", str(tmp_path / "on.json")]) == 0
    on = capsys.readouterr().out
    assert "assumption: autocast weight cache off, as train.py runs it" in off and "cache on" not in off
    assert "assumption: autocast weight cache on (--autocast-cache)" in on
    for text in (off, on):
        assert "assumption: the total is a steady-state step as train.py runs it" in text
        assert "  total (peak of the whole step)" in text and "buffers (causal masks, bool)" in text
    data = {k: json.loads((tmp_path / f"{k}.json").read_text()) for k in ("off", "on")}
    assert data["off"]["config"]["autocast_cache"] is False and data["on"]["config"]["autocast_cache"] is True
    # full with wide layers and few tokens: the cache's weight copies of every block dominate the forward
    assert data["on"]["estimate"]["peak_bytes"] > data["off"]["estimate"]["peak_bytes"]
    assert data["on"]["estimate"]["activation_bytes"] > 1.5 * data["off"]["estimate"]["activation_bytes"]


def test_cli_bad_override_is_one_line_exit_2() -> None:
    r = _cli("model=nope")
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["batch_size=abc"], "batch_size"),
        (["no_such_key=1"], "no_such_key"),
        (["policy=every_k", "policy.k=99"], "policy.k=99"),
        (["--budget", "lots"], "--budget"),
        (["precision=16-mixed"], "--device cuda"),
        (["policy=auto"], "auto"),  # no budget (or, where no auto policy is registered, no such policy)
    ],
)
def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], args: list[str], fragment: str) -> None:
    assert main(["model=micro", "seq_len=32", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and fragment in err, err


@pytest.mark.skipif("auto" not in POLICIES, reason="no auto (memory-budget planner) policy registered")
def test_cli_estimates_the_plan_the_planner_chose(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """policy=auto: the CLI asks the planner for its plan (stubbed), prints its explanation, estimates that plan."""
    import trainer.estimate as est_module
    from trainer.policies import Plan, Segment

    chosen = Plan((Segment(0, 1, "checkpoint"), Segment(1, 2, "store")))
    monkeypatch.setattr(est_module, "planner_plan", lambda config: (chosen, "PLANNER: block 0 full, block 1 none"))
    assert main(["model=micro", "seq_len=32", "policy=auto", "policy.budget_mib=100"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PLANNER: block 0 full, block 1 none")
    assert "memory, policy=auto (plan [0]:full [1]:none)" in out
    assert "| auto * | [0]:full [1]:none |" in out


def test_cli_does_not_fit_names_the_policies_that_do(capsys: pytest.CaptureFixture[str]) -> None:
    # micro, 8 layers, 16 × 64 tokens: `none` needs ~21 MiB in all, `full` ~6 MiB
    assert main(["model=micro", "model.n_layer=8", "seq_len=64", "batch_size=16", "--budget", "12MiB"]) == 0
    out = capsys.readouterr().out
    verdict = next(line for line in out.splitlines() if line.startswith("policy=none"))
    assert "does not fit in 12.0 MiB" in verdict and "policies that fit: " in verdict
    assert "full" in verdict.split("policies that fit: ")[1] and "selective" not in verdict
    assert "| none * | [0-7]:none |" in out and out.count("| no |") >= 4
