"""The estimator held to real training runs: for every registered policy, on every model family (GPT, LLaMA,
Hugging Face Llama and GPT-2) at two shapes, the estimate's activation peak and whole-step peak against the
`activation_peak_mib` and `peak_total_mib` a real `trainer.core.run.train` run writes to summary.json; FLOPs against
FlopCounterMode over a real step; Korthikanti et al.'s per-layer bytes at GPT-3's layer shape; the command line.

The estimator runs the real module on fake tensors through the same step and the same StepMeter as the run, so the
two agree to the byte on CPU; the assertion holds them within ESTIMATE_TOLERANCE (0.5 %).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from models import FAMILIES
from tests.conftest import NATIVE_FAMILIES, ROOT
from trainer import precision
from trainer.core.run import train
from trainer.core.schema import ConfigError, compose_config, validate
from trainer.estimate import (
    CudaKernelRules,
    Estimate,
    default_policy,
    estimate_all,
    main,
    measure,
    open_session,
    parse_bytes,
)
from trainer.formatting import MIB
from trainer.policies import POLICIES, build_policy, policy_params

ESTIMATE_TOLERANCE = 0.005  # the contract, relative
# What is observed on these shapes: the run holds 8 bytes more (one of Lightning's scalars). An absolute bound as well,
# so that a byte-level slip in modelling Lightning's step (e.g. its loader's read-ahead batch, 768 B here) is caught.
ESTIMATE_SLACK_BYTES = 64

# The four families at test size (each at least 2 layers, so every policy's conf defaults fit).
MODELS = {
    **{family: FAMILIES[family].tiny_overrides for family in NATIVE_FAMILIES},
    "hf-llama": ["model=hf", "model.attention=eager"],  # + model.name_or_path (the session's tiny folder)
    "hf-gpt2": ["model=hf", "model.attention=eager"],
    # layers one level down (model.decoder.layers); attention inline with transformers' own eager (no SDPA)
    "hf-opt": ["model=hf", "model.attention=eager"],
    "hf-bloom": ["model=hf", "model.attention=eager"],
}
# Two shapes: fp32 with the standard head; bf16 autocast with accumulation, SDPA and the chunked head.
SHAPES = {
    "fp32": ["seq_len=32", "batch_size=4", "precision=32-true"],
    "bf16-accum-chunked": [
        "seq_len=24",
        "batch_size=2",
        "accum=2",
        "precision=bf16-mixed",
        "model.attention=sdpa",
        "loss=chunked",
        "loss.chunk_tokens=16",
    ],
}
RUN = [
    "trainer.max_steps=2",
    "trainer.enable_checkpointing=false",
    "trainer.val_batches=1",
    "measure.warmup_steps=1",
    "measure.activation_every_n_steps=1",
]
# auto plans at fit start (tests/test_planner.py); a compile-time policy is not estimated (tests/test_compiled.py)
POLICY_NAMES = [p for p in POLICIES if p != "auto" and not POLICIES[p].caps.not_estimated(False)]


def assert_estimate_equals_run(est: Any, summary: dict[str, Any]) -> None:
    """The contract: the estimate's activation and whole-step peaks are the run's, within both bounds."""
    assert summary["status"] == "completed" and summary["plan"] == est.plan
    for what, estimated, run in (
        ("activation_peak_mib", est.activation_bytes, summary["activation_peak_mib"] * MIB),
        ("peak_total_mib", est.peak_bytes, summary["peak_total_mib"] * MIB),
    ):
        error = estimated / run - 1
        assert abs(error) <= ESTIMATE_TOLERANCE, f"{what}: estimated {estimated} B, the run {run:.0f} B ({error:+.3%})"
        assert abs(estimated - run) <= ESTIMATE_SLACK_BYTES, f"{what}: estimated {estimated} B, the run {run:.0f} B"


@pytest.fixture
def overrides(hf_models: dict[str, Path]) -> Callable[[str, str], list[str]]:
    def _overrides(model: str, shape: str) -> list[str]:
        extra = [f"model.name_or_path={hf_models[model.split('-')[1]]}"] if model.startswith("hf-") else []
        return [*MODELS[model], *extra, *SHAPES[shape]]

    return _overrides


def _with_policy(cfg: Any, policy: str) -> Any:
    """The composed config with `policy` at its conf/policy defaults."""
    from omegaconf import OmegaConf

    cfg.policy = OmegaConf.create(policy_params(default_policy(policy)))
    return cfg


# Every model × shape × policy for the four families; OPT under every policy and Bloom under the policies it takes
# (no seam: not selective) in fp32, to keep the suite's time.
CASES = [(m, shape, p) for m in (*NATIVE_FAMILIES, "hf-llama", "hf-gpt2") for shape in SHAPES for p in POLICY_NAMES]
CASES += [("hf-opt", "fp32", p) for p in POLICY_NAMES] + [("hf-bloom", "fp32", p) for p in ("full", "op_sac")]


@pytest.mark.parametrize("model, shape, policy", CASES)
def test_estimate_equals_a_training_run(
    compose_cfg: Callable[..., Any],
    overrides: Callable[[str, str], list[str]],
    tmp_path: Path,
    model: str,
    shape: str,
    policy: str,
) -> None:
    cfg = _with_policy(compose_cfg(*overrides(model, shape), *RUN), policy)
    est = measure(open_session(validate(cfg)), build_policy(validate(cfg).policy))
    summary = train(cfg, tmp_path / "run")
    assert_estimate_equals_run(est, summary)


@pytest.mark.parametrize("policy", ["none", "torchtitan_sac"])
def test_torchtitans_llama_of_2024_estimates_as_it_runs(
    compose_cfg: Callable[..., Any], overrides: Callable[[str, str], list[str]], tmp_path: Path, policy: str
) -> None:
    """The LLaMA torchtitan's published H100 rows ran (its rotary as fp32 complex numbers, keys and values copied to
    every query head before SDPA: model.rope=complex model.repeat_kv=true) is estimated as it trains."""
    extra = ["model.rope=complex", "model.repeat_kv=true"]
    cfg = _with_policy(compose_cfg(*overrides("llama", "bf16-accum-chunked"), *extra, *RUN), policy)
    est = measure(open_session(validate(cfg)), build_policy(validate(cfg).policy))
    assert_estimate_equals_run(est, train(cfg, tmp_path / "run"))


def test_the_comparison_can_fail(
    compose_cfg: Callable[..., Any], overrides: Callable[[str, str], list[str]], tmp_path: Path
) -> None:
    """The tolerance is tight enough to catch the effects the estimate must model: the CUDA kernel rules applied to a
    CPU run (1-byte dropout masks) miss it, and so does the wrong loss head at a vocabulary where the head matters
    (the standard head's bytes for a chunked run)."""
    cfg = _with_policy(compose_cfg(*overrides("gpt", "fp32"), *RUN), "none")
    summary = train(cfg, tmp_path / "run")
    config = validate(cfg)
    cuda_rules = measure(open_session(config, device="cuda"), build_policy("none"))
    assert abs(cuda_rules.activation_bytes / (summary["activation_peak_mib"] * MIB) - 1) > 10 * ESTIMATE_TOLERANCE
    chunked = _with_policy(compose_cfg(*overrides("gpt", "bf16-accum-chunked"), "model.vocab_size=8192", *RUN), "full")
    run = train(chunked, tmp_path / "chunked")
    config = validate(chunked)
    standard = measure(open_session(config), build_policy("full"), loss=type(config.loss)("standard"))
    assert abs(standard.activation_bytes / (run["activation_peak_mib"] * MIB) - 1) > 10 * ESTIMATE_TOLERANCE


# ----------------------------------------------------------------------------------------------------
# FLOPs: what FlopCounterMode counts over the same real step.
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [*NATIVE_FAMILIES, "hf-llama"])
def test_flops_equal_flop_counter_over_a_real_step(
    compose_cfg: Callable[..., Any], overrides: Callable[[str, str], list[str]], model: str
) -> None:
    from trainer.core import build
    from trainer.measure.time.flops import count_flops

    config = validate(compose_cfg(*overrides(model, "fp32")))
    session = open_session(config)
    totals = {}
    for name in ("none", "full", "selective", "op_sac"):
        est = measure(session, default_policy(name))
        torch.manual_seed(0)
        module = build.module(config, default_policy(name), vocab_size=256, hf_config=build.hf_config(config))
        batch = tuple(torch.randint(0, module.adapter.head.weight.shape[0], (4, 32)) for _ in range(2))
        real = count_flops(lambda m=module, b=batch: m.loss_of(b).backward())
        assert est.flops == real, name
        totals[name] = est.flops
    assert totals["full"] > totals["op_sac"] > totals["none"]  # recompute costs FLOPs; none recomputes nothing


# ----------------------------------------------------------------------------------------------------
# The paper check: Korthikanti et al. 2022, Table 2, bytes per layer at GPT-3's layer shape.
# ----------------------------------------------------------------------------------------------------

GPT3_LAYER = [
    "model=gpt2",
    "model.n_layer=1",
    "model.n_embd=12288",
    "model.n_head=96",
    "model.block_size=2048",
    "seq_len=2048",
    "batch_size=1",
    "model.attention=eager",
    "model.dropout=0.1",
    "precision=bf16-true",
]


@pytest.mark.parametrize("policy, mib", [("none", 2740.0), ("selective", 816.0), ("full", 48.0)])
def test_korthikanti_table_2_at_gpt3_layer_shape(policy: str, mib: float) -> None:
    """s=2048, b=1, h=12288, a=96, 16-bit, dropout 0.1, eager attention, translated to CUDA's kernels:
    sbh(34 + 5as/h) = 2,736 MiB (+ 4 MiB: the inverted causal mask masked_fill keeps), 34·sbh = 816 MiB with
    selective recompute, 2·sbh = 48 MiB (the layer's output: the next checkpoint's input) with full recompute."""
    est = measure(open_session(compose_config(GPT3_LAYER), device="cuda"), build_policy(policy))
    assert abs(est.kept_per_layer[0] / MIB - mib) < 0.05, est.kept_per_layer[0] / MIB


S, H, A, TP = 2048, 12288, 96, 8  # GPT-3's layer (b = 1), split 8 ways as in the paper's Table 2
SBH_MIB = S * H / MIB  # sbh bytes at b = 1: the paper's formulas count bytes with 16-bit activations
# Table 2's per-rank terms with tensor parallelism t, and with sequence parallelism added, in units of sbh
TABLE_2_TP = [
    (False, "none", 10 + 24 / TP + 5 * A * S / (H * TP)),
    (False, "selective", 10 + 24 / TP),
    (False, "full", 2),
    (True, "none", (34 + 5 * A * S / H) / TP),
    (True, "selective", 34 / TP),
    (True, "full", 2 / TP),
]


@pytest.mark.parametrize("sequence_parallel, policy, sbh", TABLE_2_TP)
def test_korthikanti_table_2_with_tensor_and_sequence_parallelism(
    sequence_parallel: bool, policy: str, sbh: float
) -> None:
    """One rank of TP 8 on fake tensors at GPT-3's layer shape keeps the paper's sbh(10 + 24/t + 5as/(ht)),
    sbh(10 + 24/t) and 2sbh without SP, and sbh/t · (34 + 5as/h), 34sbh/t and 2sbh/t with it, plus two things the
    paper's Megatron does not keep: the 4 MiB inverted causal mask (no recompute, as in Table 2 above) and, with
    SP, the block input each column-split projection all-gathers and saves whole for its backward where Megatron
    saves its sequence shard and gathers again (attention's and the MLP's: 2 · 2sbh(1 − 1/t))."""
    config = compose_config(
        GPT3_LAYER
        + ["trainer=fsdp2", f"trainer.devices={TP}", f"trainer.tensor_parallel={TP}"]
        + [f"trainer.sequence_parallel={sequence_parallel}"]
    )
    session = open_session(config, device="cuda")
    try:
        kept = measure(session, build_policy(policy)).kept_per_layer[0] / MIB
    finally:
        session.close()
    mask = 4.0 if policy == "none" else 0.0
    gathered = 4 * (1 - 1 / TP) * SBH_MIB if sequence_parallel and policy != "full" else 0.0
    assert abs(kept - (sbh * SBH_MIB + mask + gathered)) < 0.05, (kept, sbh * SBH_MIB)


def test_cuda_rules_translate_exactly_what_they_name(compose_cfg: Callable[..., Any]) -> None:
    """On a shape small enough to count by hand: each dropout mask drops from the input dtype to 1 byte."""
    config = validate(
        compose_cfg(
            "model=micro",
            "model.n_layer=1",
            "seq_len=16",
            "batch_size=2",
            "precision=bf16-true",
            "model.attention=eager",
        )
    )
    cpu = measure(open_session(config, device="cpu"), build_policy("none"))
    cuda = measure(open_session(config, device="cuda"), build_policy("none"))
    B, T, C, H = 2, 16, 32, 2
    # in the layer: the attention probabilities' dropout (B·H·T²) and the two residual-branch dropouts (B·T·C each),
    # 2 bytes per element (bf16 noise) on CPU, 1 (a bool mask) on CUDA
    assert cpu.kept_per_layer[0] - cuda.kept_per_layer[0] == (B * H * T * T + 2 * B * T * C) * (2 - 1)
    original = torch.nn.functional.dropout
    with CudaKernelRules():
        assert torch.nn.functional.dropout is not original
    assert torch.nn.functional.dropout is original  # restored


SDPA_LLAMA = ["model=llama-tiny", "model.n_layer=2", "seq_len=32", "batch_size=2", "model.attention=sdpa"]


@pytest.mark.parametrize("policy", ["op_sac", "torchtitan_sac", "torchtitan_sac:0.2", "none", "full"])
def test_cuda_estimate_runs_cuda_attention_and_saves_what_each_policy_names(
    monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """A CUDA estimate on this CPU-only torch runs the attention kernel a GPU runs (flash, for bf16 GQA), so SAC save
    lists written with CUDA op names apply: every decision a policy made is listed by op, and the attention kernel's
    is the policy's own answer for `aten._scaled_dot_product_flash_attention`, saved under all three lists. No CPU
    SDPA kernel runs at all (the whole step's ops are listed too)."""
    import torch.utils.checkpoint as ckpt
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainer.policies import library

    decisions: dict[Any, set[Any]] = {}

    def recording(policy_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        def decide(ctx: Any, op: Any, *a: Any, **kw: Any) -> Any:
            decision = policy_fn(ctx, op, *a, **kw)
            decisions.setdefault(op, set()).add(decision)
            return decision

        return ckpt.create_selective_checkpoint_contexts(decide, *args, **kwargs)

    monkeypatch.setattr(library, "create_selective_checkpoint_contexts", recording)
    name, _, version = policy.partition(":")
    pol = build_policy({"name": name, **({"version": version} if version else {})})
    ran: set[str] = set()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            ran.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    session = open_session(compose_config([*SDPA_LLAMA, "precision=bf16-mixed"]), device="cuda")
    with Ops():
        measure(session, pol)
    assert "aten._scaled_dot_product_flash_attention" in ran
    assert not any(op.endswith("_for_cpu") or "_for_cpu_" in op for op in ran), sorted(ran)
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    if name in ("none", "full"):
        assert decisions == {}
        return
    save = pol.save if name == "torchtitan_sac" else library.resolve_ops(pol.cfg.save_ops)
    expected = ckpt.CheckpointPolicy.MUST_SAVE if (flash in save or flash.overloadpacket in save) else None
    assert expected is ckpt.CheckpointPolicy.MUST_SAVE  # every shipped list names the CUDA flash kernel
    assert decisions[flash] == {expected}
    assert not any("_for_cpu" in str(op) for op in decisions)


def test_cuda_flash_attention_keeps_what_the_cpu_kernel_keeps_and_its_rng_state() -> None:
    """Counted by hand: CUDA's flash kernel keeps the output and the fp32 log-sum-exp as the CPU's fused kernel does,
    and its RNG state besides (a (2,) uint64 seed and a () uint64 offset, torch's meta kernel): 24 bytes per layer."""
    config = compose_config([*SDPA_LLAMA, "precision=bf16-mixed"])
    cpu = measure(open_session(config, device="cpu"), build_policy("none"))
    cuda = measure(open_session(config, device="cuda"), build_policy("none"))
    assert [c - p for c, p in zip(cuda.kept_per_layer, cpu.kept_per_layer, strict=True)] == [24, 24]


def test_cuda_estimate_of_fp32_gqa_attention_keeps_the_math_paths_scores() -> None:
    """fp32 inputs rule flash out and GQA rules torch's memory-efficient kernel out, so a GPU runs the math path.
    Counted by hand per layer, fp32: the math path keeps the scaled query, the scaled keys and the values repeated
    to all H heads (B·H·T·D each) and the probabilities (B·H·T²); the CPU's fused kernel keeps the query (B·H·T·D),
    keys and values at their own heads (B·Hkv·T·D each) and its log-sum-exp (B·H·T). Both keep the attention's
    output for the output projection: the fused kernel's is already laid out (B, T, H, D), the math path's is
    copied so by `.contiguous()`."""
    config = compose_config([*SDPA_LLAMA[:2], "seq_len=16", *SDPA_LLAMA[3:], "precision=32-true"])
    cpu = measure(open_session(config, device="cpu"), build_policy("none"))
    cuda = measure(open_session(config, device="cuda"), build_policy("none"))
    B, H, HKV, T, D = 2, 8, 2, 16, 32
    kept_math = 3 * B * H * T * D + B * H * T * T
    kept_fused = B * H * T * D + 2 * B * HKV * T * D + B * H * T
    diff = (kept_math - kept_fused) * 4
    assert [c - p for c, p in zip(cuda.kept_per_layer, cpu.kept_per_layer, strict=True)] == [diff, diff]


# torch's CUDA dispatch (sdp_utils.cpp, select_sdp_backend) in its default order on sm80+, case by case: the rule each
# case turns on. q: (2, 8, T=16, head); k and v: (2, kv_heads, 16 or 24, head); causal throughout.
SDPA_CASES = [
    ("bf16 GQA: flash runs grouped heads itself", torch.bfloat16, 2, False, 64, 16, None, "flash"),
    ("fp32: flash is 16-bit only, memory-efficient takes it", torch.float32, 8, False, 64, 16, None, "efficient"),
    ("fp32 GQA: torch 2.13's memory-efficient kernel has no GQA", torch.float32, 2, False, 64, 16, None, "math"),
    ("a mask: flash takes none", torch.bfloat16, 8, True, 64, 16, None, "efficient"),
    ("head size 320 > 256: not flash", torch.bfloat16, 8, False, 320, 16, None, "efficient"),
    ("head size 36: flash pads it to 40", torch.bfloat16, 8, False, 36, 16, None, "flash"),
    ("head size 36 in fp32: a multiple of 4, memory-efficient", torch.float32, 8, False, 36, 16, None, "efficient"),
    ("head size 34 in fp32: not a multiple of 4", torch.float32, 8, False, 34, 16, None, "math"),
    ("causal with more keys than queries: not flash", torch.bfloat16, 8, False, 64, 24, None, "efficient"),
    ("flash disabled by the user", torch.bfloat16, 8, False, 64, 16, "EFFICIENT_ATTENTION", "efficient"),
    ("only math enabled", torch.bfloat16, 8, False, 64, 16, "MATH", "math"),
]


@pytest.mark.parametrize(
    "why, dtype, kv_heads, mask, head, keys, only, kernel", SDPA_CASES, ids=[c[0] for c in SDPA_CASES]
)
def test_cuda_sdpa_picks_the_kernel_torchs_dispatch_picks(
    why: str, dtype: torch.dtype, kv_heads: int, mask: bool, head: int, keys: int, only: str | None, kernel: str
) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainer.measure.fake.cuda_attention import cuda_sdpa_kernel

    q = torch.empty(2, 8, 16, head, dtype=dtype)
    k = v = torch.empty(2, kv_heads, keys, head, dtype=dtype)
    attn_mask = torch.ones(16, keys, dtype=torch.bool) if mask else None
    causal = attn_mask is None
    ctx = sdpa_kernel(getattr(SDPBackend, only)) if only else contextlib.nullcontext()
    with ctx:
        assert cuda_sdpa_kernel(q, k, v, attn_mask, 0.0, causal, enable_gqa=kv_heads != 8) == kernel, why


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: compares the rule with torch's own dispatch")
@pytest.mark.parametrize(
    "why, dtype, kv_heads, mask, head, keys, only, kernel", SDPA_CASES, ids=[c[0] for c in SDPA_CASES]
)
def test_the_sdpa_rule_picks_what_torch_picks_on_this_gpu(
    why: str, dtype: torch.dtype, kv_heads: int, mask: bool, head: int, keys: int, only: str | None, kernel: str
) -> None:
    """On a GPU, torch's own choice (`torch._fused_sdp_choice`) for each case, inputs requiring gradients as in
    training: the rule's, or cuDNN where the rule says flash (torch puts cuDNN first on sm90/sm100 with a recent
    cuDNN; the rule keeps flash, the same bytes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainer.measure.fake.cuda_attention import cuda_sdpa_kernel

    q = torch.randn(2, 8, 16, head, dtype=dtype, device="cuda", requires_grad=True)
    k, v = (torch.randn(2, kv_heads, keys, head, dtype=dtype, device="cuda", requires_grad=True) for _ in range(2))
    attn_mask = torch.ones(16, keys, dtype=torch.bool, device="cuda") if mask else None
    gqa, causal = kv_heads != 8, attn_mask is None
    with sdpa_kernel(getattr(SDPBackend, only)) if only else contextlib.nullcontext():
        ours = cuda_sdpa_kernel(q, k, v, attn_mask, 0.0, causal, enable_gqa=gqa)
        theirs = SDPBackend(torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, causal, enable_gqa=gqa)).name
    names = {"flash": {"FLASH_ATTENTION", "CUDNN_ATTENTION"}, "efficient": {"EFFICIENT_ATTENTION"}, "math": {"MATH"}}
    assert theirs in names[ours], (why, ours, theirs)


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_cuda_math_path_written_out_is_torchs_composite(monkeypatch: pytest.MonkeyPatch, kv_heads: int) -> None:
    """Under dropout the math path is written out (CUDA's fused dropout); with dropout made the identity, it computes
    exactly what torch's own composite computes without dropout: upcast, scaling, causal mask, GQA repeat, softmax."""
    from trainer.measure.fake import cuda_attention

    torch.manual_seed(0)
    q = torch.randn(2, 8, 16, 32, dtype=torch.bfloat16)
    k, v = (torch.randn(2, kv_heads, 16, 32, dtype=torch.bfloat16) for _ in range(2))
    monkeypatch.setattr(torch, "native_dropout", lambda x, p, train: (x, torch.ones_like(x, dtype=torch.bool)))
    written = cuda_attention._math(q, k, v, None, 0.5, True, 0.2, kv_heads != 8)
    composite = torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, None, 0.0, True, scale=0.2, enable_gqa=kv_heads != 8
    )[0]
    assert written.dtype == composite.dtype == torch.bfloat16
    assert torch.equal(written, composite)


# ----------------------------------------------------------------------------------------------------
# Precision follows train.py's rule.
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("native, chosen", [(True, "bf16-mixed"), (False, "32-true")])
def test_estimator_settles_precision_auto_as_train_does(
    monkeypatch: pytest.MonkeyPatch, compose_cfg: Callable[..., Any], native: bool, chosen: str
) -> None:
    monkeypatch.setattr(precision, "cpu_bf16_native", lambda: (native, "probe"))
    session = open_session(validate(compose_cfg("precision=auto")), device="cpu")
    assert session.precision == chosen
    assert any(f"precision=auto → {chosen}" in n for n in session.notes)


# ----------------------------------------------------------------------------------------------------
# The table and the command line.
# ----------------------------------------------------------------------------------------------------


def test_every_policy_in_the_table_ranks_as_theory_says(compose_cfg: Callable[..., Any]) -> None:
    config = validate(compose_cfg("model.n_layer=4", "seq_len=64", "precision=32-true"))
    table = estimate_all(config)
    assert list(table) == list(POLICIES)
    est = {k: v for k, v in table.items() if isinstance(v, Estimate)}
    assert isinstance(table["auto"], str) and "budget" in table["auto"]
    act = {k: v.activation_bytes for k, v in est.items()}
    assert act["none"] > act["selective"] > act["full"] and act["none"] > act["op_sac"] > act["full"]
    assert act["offload"] == act["none"]  # CPU: nothing to move
    assert est["full"].flops > est["op_sac"].flops > est["selective"].flops > est["none"].flops
    assert est["none"].kept_per_layer == [est["none"].kept_per_layer[0]] * 4


def test_a_worker_process_makes_the_same_tables_as_this_one(
    compose_cfg: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tables split over a spawned worker (start-up charged nothing, so it starts even for this small model)
    are this process's, figure for figure; without that push a model this small stays in one process. The ops'
    work is the same op for op; only the optimizer's scalars in their signatures differ (AdamW's bias corrections
    follow how many steps the session has taken, and each process's session took others)."""
    from collections import Counter

    from trainer.estimate.tables import estimate_tables

    def work(e: Estimate) -> Counter[tuple[str, str, int, int]]:
        ops: Counter[tuple[str, str, int, int]] = Counter()
        for k, n in e.work.ops.items():
            ops[(k.kind, k.dtype, k.flops, k.nbytes)] += n
        return ops

    import concurrent.futures

    pools = []

    class Pool(concurrent.futures.ProcessPoolExecutor):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pools.append(self)
            super().__init__(*args, **kwargs)

    config = validate(compose_cfg("precision=32-true"))
    one = estimate_tables(config, "cpu", workers=1)
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Pool)
    two = estimate_tables(config, "cpu", workers=2, startup_s=0.0)
    assert len(pools) == 1  # the worker did start
    for a, b in zip(one, two, strict=True):
        assert list(a) == list(b)
        for name in a:
            if isinstance(a[name], str):
                assert a[name] == b[name], name
                continue
            ea, eb = dataclasses.asdict(a[name]), dataclasses.asdict(b[name])
            assert {k: v for k, v in ea.items() if k != "work"} == {k: v for k, v in eb.items() if k != "work"}, name
            assert work(a[name]) == work(b[name]), name


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


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "trainer.estimate", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_cli_llama_at_size_prints_the_table_verdict_and_json(tmp_path: Path) -> None:
    """A LLaMA-3-1B-shaped model at 2 × 2048 tokens: no data, no weights allocated."""
    out = tmp_path / "est" / "out.json"
    r = _cli(
        "model=llama3-1b",
        "seq_len=2048",
        "batch_size=2",
        "policy=full",
        "precision=bf16-mixed",
        "--device",
        "cuda",
        "--budget",
        "40GB",
        "--json",
        str(out),
        "--policies",
        "configured",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| full * | [0-15]:full |" in r.stdout and "policy=full fits in 40 GB" in r.stdout
    assert "translated to CUDA's kernels" in r.stdout
    data = json.loads(out.read_text())
    e = data["estimate"]
    assert data["policy"] == "full" and data["fits"] is True and data["budget_bytes"] == 40 * 10**9
    assert e["peak_bytes"] == e["components"]["total"] and e["activation_bytes"] == e["components"]["activation_peak"]
    assert len(e["kept_per_layer"]) == 16 and e["flops"] == e["fwd_flops"] + e["bwd_flops"]
    # bf16 autocast keeps the residual stream in fp32: each layer keeps its fp32 output, 2 × 2048 × 2048 × 4 B
    assert e["kept_per_layer"] == [2 * 2048 * 2048 * 4] * 16
    assert data["config"]["params"] == 1_235_814_400  # Llama-3.2-1B (tied head)
    assert set(data["loss_heads"]) == {"standard", "chunked", "fused"}
    heads = {k: v["head_bytes"] for k, v in data["loss_heads"].items()}
    # at vocab 128,256 the logits dominate the head; what stays is the weight's bf16 copy and (tied) gradient buffer
    assert heads["chunked"] < heads["standard"] / 2 and heads["fused"] < heads["standard"] / 2
    # --device cuda without --gpu: step times predicted for the reference GPU, labelled, with their assumptions
    assert data["step_time_device"] == "H100-80GB"
    assert any("FSDP2 collectives at 76% (published 71%-80%) of 450 GB/s" in a for a in data["step_time_assumptions"])
    t = e["predicted_step"]
    assert t["device"] == "H100-80GB" and t["ms"] >= t["matmul_ms"] >= t["attention_ms"] > 0
    assert t["tokens_per_s"] == pytest.approx(2 * 2048 / (t["ms"] / 1e3))
    # the interval over the published efficiency ranges holds the middle
    assert t["ms_range"][0] < t["ms"] < t["ms_range"][1]
    assert t["tokens_per_s_range"][0] < t["tokens_per_s"] < t["tokens_per_s_range"][1]
    # the time model's FLOPs are the kernels' (causal attention's skipped scores left out), the figure torch's count
    assert e["flops"] > e["work"]["flops"] > 0.9 * e["flops"] and e["work"]["sac_decisions"] == 0  # full: no SAC
    assert "predicted step ms | predicted tokens/s |" in r.stdout
    assert "step time predicted (not measured) for H100-80GB" in r.stdout


def test_cli_gpu_names_the_device_and_refuses_a_wrong_one() -> None:
    r = _cli("model=micro", "seq_len=32", "--policies", "configured", "--gpu", "l4-24gb")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step time predicted (not measured) for L4-24GB" in r.stdout and "device=cuda" in r.stdout
    # --no-time never looks the GPU up, and once accepted an unknown name without a word
    for args in (["--gpu", "Z9000"], ["--gpu", "Z9000", "--no-time"], ["--gpu", "L4-24GB", "--device", "cpu"]):
        bad = _cli("model=micro", "seq_len=32", "--policies", "configured", *args)
        assert bad.returncode == 2 and bad.stderr.startswith("error: --gpu "), bad.stderr
        assert bad.stderr.count("\n") == 1, bad.stderr


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
        (["precision=16-mixed", "--device", "cpu"], "--device cuda"),
        (["policy=auto"], "budget"),
        (["model=llama-tiny", "model.n_head=8", "model.n_kv_head=3"], "n_kv_head=3"),
        (["model=hf", "model.name_or_path=/nonexistent/folder"], "no such folder"),
        (["loss=bogus"], "loss"),
        (["loss=chunked", "loss.chunk_tokens=0"], "chunk_tokens=0"),
        (["loss=chunked", "loss.chunk_tokens=100000"], "larger than the micro-batch"),
        (["model.vocab_size=100"], "smaller than the tokenizer's 256"),  # the run's rule: refused, not estimated
        (["--json", "/"], "is a folder"),  # refused before the work
        (["--json", "/proc/estimate.json"], "cannot write under /proc"),  # root too: tried, not os.access
        (["data.tokenizer=bpe", "data.bpe_vocab_size=10"], "bpe_vocab_size=10 is too small"),  # as the run says
        (["data.tokenizer=model"], "needs model=hf"),
        (["--policies", "bogus"], "--policies"),
        (["--alloc-conf", "expandable_segments:true"], "write True or False"),  # torch's own spelling
        (["--alloc-conf", "expandable:True"], "not one of torch's"),
        (["model=llama-tiny", "model.rope=complex", "precision=bf16-true"], "imaginary part"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], args: list[str], fragment: str) -> None:
    try:
        code = main(["model=micro", "seq_len=32", *args])
    except SystemExit as e:  # argparse's own refusals exit from inside main
        code = e.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and fragment in err, err


def test_cli_estimates_the_plan_the_planner_chose(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """policy=auto: the CLI asks the planner for its plan (stubbed here; the planner's own tests are in
    tests/test_planner.py), prints its explanation, and estimates that plan."""
    import trainer.estimate.cli as est_module
    from trainer.policies import Plan

    chosen = Plan.per_block(["full", "none"])
    plan = (chosen, "standard", "PLANNER: [0]:full")
    monkeypatch.setattr(est_module, "planner_plan", lambda config, device, speed=None: plan)
    assert main(["model=micro", "seq_len=32", "policy=auto", "policy.budget_mib=100"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PLANNER: [0]:full")
    assert "memory, policy=auto (plan [0]:full [1]:none)" in out
    assert "| auto * | [0]:full [1]:none |" in out


def test_cli_does_not_fit_names_the_policies_that_do(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["model=micro", "model.n_layer=8", "seq_len=64", "batch_size=4", "precision=32-true", "--budget", "4MiB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    verdict = next(line for line in out.splitlines() if line.startswith("policy=none"))
    assert "does not fit in 4.0 MiB" in verdict and "policies that fit: " in verdict
    assert "full" in verdict.split("policies that fit: ")[1] and "selective" not in verdict.split(": ")[-1]


def test_chunked_is_chunked_at_the_default_shape(compose_cfg: Callable[..., Any]) -> None:
    """At the default micro-batch (4 × 256 tokens) loss.chunk_tokens is null: the tokens in 8 chunks, so a chunked
    head holds less than the standard one, and so does the step (a BPE vocabulary of 8,192)."""
    from trainer.loss import DEFAULT_CHUNKS

    est = {}
    for head in ("standard", "chunked"):
        config = validate(compose_cfg(f"loss={head}", "data.tokenizer=bpe", "data.bpe_vocab_size=8192", small=False))
        assert config.loss.chunk_tokens is None
        est[head] = measure(open_session(config), build_policy(config.policy))
    assert validate(compose_cfg(small=False)).loss.chunk_for(4 * 256) == 4 * 256 // DEFAULT_CHUNKS
    assert est["chunked"].head_bytes < est["standard"].head_bytes / 2
    assert est["chunked"].activation_bytes < est["standard"].activation_bytes


def test_fsdp2_grouped_blocks_explain_the_view_warning_once() -> None:
    """Under FSDP2 a grouped plan's blocks before the group's last return their input as a stand-in, and torch warned
    about a returned view at each of them; the output says once why no in-place op can follow it instead."""
    args = ["model=llama-tiny", "trainer=fsdp2", "trainer.devices=2", "seq_len=32", "--no-time"]
    r = _cli(*args, "policy=sqrt", "--policies", "configured")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "UserWarning: FSDP2-wrapped module" not in r.stderr
    assert r.stderr.count("return their input as a stand-in") == 1, r.stderr[-2000:]
    full = _cli(*args, "policy=full", "--policies", "configured")  # no group: nothing to explain
    assert full.returncode == 0 and "stand-in" not in full.stderr, full.stderr[-2000:]


def test_a_cuda_estimate_steps_adamw_as_torch_does_for_cuda_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch picks AdamW's foreach implementation for CUDA parameters and never for fake ones: a CUDA estimate asks
    for it, so the optimizer phase holds foreach's temporaries (up to a copy of one parameter group) as a CUDA run
    does; a CPU estimate keeps the per-parameter loop a CPU run takes. Parameters dominate this step, so the
    optimizer phase sets its peak."""
    from models import build_model
    from trainer.core.module import DecoderModule

    config = compose_config(["model=llama-tiny", "policy=full", "batch_size=1", "seq_len=16", "precision=32-true"])
    foreach = measure(open_session(config, device="cuda"), build_policy("full"))
    cpu = measure(open_session(config, device="cpu"), build_policy("full"))
    assert foreach.total_peak_at == "optimizer" and any("foreach" in n for n in foreach.notes)
    assert not any("foreach" in n for n in cpu.notes)
    monkeypatch.setattr(DecoderModule, "optimizer_foreach", property(lambda self: None, lambda self, value: None))
    loop = measure(open_session(config, device="cuda"), build_policy("full"))
    params = sum(p.numel() * 4 for p in build_model(config.model, 256).parameters())
    assert 0.5 * params < foreach.peak_bytes - loop.peak_bytes <= params


def test_the_advice_plans_auto_for_the_gpu_named(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """--advise's `policy=auto` row is planned with the step times of the --gpu the estimate is for, not the
    reference GPU's (the planner ranks plans by predicted time: another GPU may rank them otherwise)."""
    from trainer.estimate import advise as advise_module

    asked: list[str | None] = []
    real = advise_module.planner_plan

    def spy(config: Any, device: str, speed: Any = None) -> Any:
        asked.append(None if speed is None else speed.name)
        return real(config, device, speed)

    monkeypatch.setattr(advise_module, "planner_plan", spy)
    args = ["model=micro", "seq_len=32", "--device", "cuda", "--gpu", "L4-24GB", "--budget", "1MiB", "--advise"]
    assert main(args) == 0
    assert asked and all(name is not None and name.startswith("L4-24GB") for name in asked), asked
    assert "policy=auto" in capsys.readouterr().out


def test_a_cuda_estimate_replays_the_caching_allocator() -> None:
    """--device cuda adds what CUDA's caching allocator would reserve for the step (≥ the tensors' peak: rounding
    and cached segments); a CPU estimate has none."""
    config = compose_config(["model=micro", "seq_len=16", "batch_size=2"])
    for device in ("cuda", "cpu"):
        session = open_session(config, device)
        try:
            est = measure(session, build_policy(config.policy))
        finally:
            session.close()
        if device == "cuda":
            assert est.reserved_bytes is not None and est.reserved_bytes >= est.peak_bytes
            assert est.reserved_bytes % (2 * 2**20) == 0  # whole segments
        else:
            assert est.reserved_bytes is None


def test_a_cuda_estimate_replays_the_allocator_as_the_run_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay reads PYTORCH_CUDA_ALLOC_CONF as torch does: expandable segments map 2 and 20 MiB pages where the
    default mode takes whole segments, so the same step reserves differently, and the estimate says which it is."""
    config = compose_config(["model=micro", "seq_len=64", "batch_size=256"])  # large-pool requests of many sizes
    found = {}
    for setting in ("", "expandable_segments:True"):
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", setting)
        session = open_session(config, "cuda")
        try:
            found[setting] = measure(session, build_policy(config.policy))
        finally:
            session.close()
    default, expandable = found[""], found["expandable_segments:True"]
    assert (default.allocator, expandable.allocator) == ("default", "expandable segments")
    assert any("caching allocator: expandable segments" in n for n in expandable.notes)
    assert default.peak_bytes == expandable.peak_bytes
    assert default.reserved_bytes != expandable.reserved_bytes


def test_a_compiled_estimate_where_a_gpu_is_visible_refuses_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only inductor's C++ paths are replaced for fake tensors: with a CUDA device visible the compiled estimate would
    run on fake CUDA tensors and inductor would emit Triton kernels and launch them. Until that path runs on a GPU,
    it refuses before anything is built, naming the way round (the GPU hidden: the CPU's step translated)."""
    config = compose_config(["model=micro", "seq_len=16", "batch_size=2", "trainer.compile=true"])
    if not torch.cuda.is_available():  # the refusal depends only on a visible device: shown as a GPU host sees it
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=") as e:
        open_session(config, "cuda")
    assert "\n" not in str(e.value)
    monkeypatch.undo()
    if not torch.cuda.is_available():  # hidden (here: none), the translated compiled estimate opens
        open_session(config, "cuda").close()


def test_a_compiled_configuration_says_what_its_compiled_estimate_approximates() -> None:
    """Under trainer.compile=true the estimate is the compiled step's (tests/test_compiled.py), and says what it
    leaves out (memory a kernel takes inside itself); an FSDP2 configuration under compile is refused in one line."""
    from trainer.estimate.session import COMPILE_NOTE

    config = compose_config(["model=micro", "seq_len=16", "batch_size=2", "trainer.compile=true"])
    session = open_session(config, "cpu")
    try:
        assert COMPILE_NOTE in session.notes
    finally:
        session.close()
    plain = open_session(compose_config(["model=micro", "seq_len=16", "batch_size=2"]), "cpu")
    try:
        assert COMPILE_NOTE not in plain.notes
    finally:
        plain.close()
    sharded = compose_config(
        ["model=micro", "seq_len=16", "trainer=fsdp2", "trainer.devices=2", "trainer.compile=true"]
    )
    with pytest.raises(ConfigError, match="trainer.compile=true with trainer=fsdp2 is not estimated yet") as e:
        open_session(sharded, "cpu")
    assert "\n" not in str(e.value)
    assert not torch.distributed.is_initialized()  # refused before any process group is made
    split = compose_config(
        ["model=micro", "seq_len=16", "trainer=fsdp2", "trainer.devices=2", "trainer.tensor_parallel=2"]
        + ["trainer.compile=true"]
    )  # one data-parallel rank: the tensor-parallel split alone refuses it (it crashed in the compiled estimate)
    with pytest.raises(ConfigError, match="with trainer.tensor_parallel is not estimated yet") as e:
        open_session(split, "cpu")
    assert "\n" not in str(e.value)
    assert not torch.distributed.is_initialized()


def test_a_compile_time_policy_is_not_estimated_eager_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    """memory_budget is decided by torch's partitioner as the model compiles: an eager configuration's table says
    so in its row, and asked for it eager, the estimator refuses in one line (no eager stand-in); under
    trainer.compile=true it is estimated (tests/test_compiled.py)."""
    config = compose_config(["model=micro", "seq_len=16", "batch_size=2"])
    table = estimate_all(config, only=["none", "memory_budget"])
    assert isinstance(table["none"], Estimate)
    assert table["memory_budget"] == "decided by torch.compile's partitioner: estimated under trainer.compile=true"
    overrides = ["model=micro", "seq_len=16", "batch_size=2", "model.dropout=0"]
    assert main([*overrides, "policy=memory_budget"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "estimated under trainer.compile=true" in err[0], err


def test_the_fake_collective_wait_is_the_estimates_alone() -> None:
    """Inside the estimate's kernel rules a collective's fake wait hands back the tensor it waited on (the run's
    kernel does); after them torch's own fake rule runs again, so a later fake trace of a collective (dynamo tracing
    a tensor-parallel step after the run's own estimate) still works."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers the _c10d_functional ops)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainer.measure.fake.kernels import cpu_kernel_rules

    def wait() -> tuple[bool, tuple[int, ...]]:
        with FakeTensorMode():
            x = torch.empty(4, 3)
            out = torch.ops._c10d_functional.wait_tensor(x)
            return out is x, tuple(out.shape)

    assert wait() == (False, (4, 3))
    with cpu_kernel_rules():
        assert wait() == (True, (4, 3))
    assert wait() == (False, (4, 3))  # failed with an empty fake-impl holder while the rule was a library's
