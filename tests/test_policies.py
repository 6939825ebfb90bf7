"""The policy family, proven: gradients, state_dict, FLOPs and memory of every policy against `none` (CPU).

The gradient matrix covers every model family behind the decoder contract (GPT, LLaMA, Hugging Face Llama and
GPT-2); the FLOP and byte accounting uses the GPT, whose every tensor the comments below name. Shapes are tiny so
the whole file runs in seconds on 2 cores. Three facts the assertions below rest on:

* Bitwise gradients. On CPU a checkpointed region is replayed with the same kernels on the same inputs, with the
  RNG state (dropout) and the autocast state restored, so every recomputed tensor is bit-identical to the stored
  one and loss and gradients equal `none`'s with `torch.equal` — for every combination of dropout, gradient
  accumulation, bf16 autocast and attention path tested here. No tolerance is needed anywhere on CPU.
* torch's early stop. A non-reentrant checkpoint stops its recompute as soon as every tensor the backward needs
  from the region has been regenerated (`torch.utils.checkpoint.set_checkpoint_early_stop`, on by default). The
  ops after the last saved tensor are never replayed: with dropout 0 that is the MLP's output projection
  (`mlp.c_proj`: addmm saves its input, not its output), and for `selective` the ·V matmul (the region's
  output is consumed outside the region). The FLOPs tests assert both the early-stop counts and, with early
  stop switched off, the textbook counts (one forward of every checkpointed block / of the core attention).
* Residual stream in fp32. Under bf16 autocast the residual stream (and thus every checkpoint's input) stays
  fp32, so "block inputs" cost 4 bytes per element in both precisions.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import io
import json
import logging
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, set_checkpoint_early_stop

from models.adapter import adapter_for
from models.gpt import GPT, GPTConfig
from tests.conftest import NATIVE_FAMILIES
from trainer import policies
from trainer.measure.memory.tracker import LiveTensorTracker
from trainer.measure.time.flops import count_flops
from trainer.policies import (
    DEFAULT_SAC_SAVE_OPS,
    POLICIES,
    PolicyError,
    apply_policy,
    build_policy,
    checkpointed,
    config_node,
    remove_policy,
)

F32, BF16 = 4, 2

# Every registered policy, with the parameters each takes; per_block both ways (pattern and blocks).
CASES: dict[str, Any] = {
    "none": "none",
    "full": "full",
    "selective": "selective",
    "sqrt": "sqrt",
    "every_k2": {"name": "every_k", "k": 2},
    "first_k1": {"name": "first_k", "k": 1},
    "first_k2": {"name": "first_k", "k": 2},
    "op_sac": "op_sac",
    "torchtitan_sac": "torchtitan_sac",
    "torchtitan_sac_02": {"name": "torchtitan_sac", "version": "0.2"},
    "offload": "offload",
    "per_block_pattern": {"name": "per_block", "pattern": ["full", "selective", "none", "op_sac"]},
    "per_block_blocks": {"name": "per_block", "blocks": ["offload", "full", "selective", "none"]},
}
NOT_NONE = [c for c in CASES if c != "none"]


def installed(model: Any) -> bool:
    """Does any layer run through a policy's forward override or a wrapped attention seam?"""
    from models.hf import WRAPPER_ATTR

    layers = adapter_for(model).layers
    seams = {"core_attention", WRAPPER_ATTR}  # a native attention's method, an HF attention module's wrapper
    return any("forward" in layer.__dict__ for layer in layers) or any(
        seams & set(m.__dict__) for layer in layers for m in layer.modules()
    )


def trivial(case: str, attention: str) -> str | None:
    """Why a case compares `none` with itself here (it installs nothing that changes the step), or None."""
    if _name(case) == "offload" and not torch.cuda.is_available():
        return "offload moves nothing without a CUDA device"
    if _name(case) == "selective" and attention == "sdpa":
        return "selective with fused SDPA recomputes nothing"
    return None


def _name(case: str) -> str:
    cfg = CASES[case]
    return cfg if isinstance(cfg, str) else cfg["name"]


@pytest.fixture(autouse=True)
def _fresh_notices() -> None:
    # say_once remembers what it said per process; every test starts with a clean slate.
    policies.base._said.clear()


def test_the_cases_cover_every_registered_policy() -> None:
    # auto: tests/test_planner.py; memory_budget (compiled only): tests/test_compiled.py
    assert {_name(c) for c in CASES} | {"auto", "memory_budget"} == set(POLICIES)


# ----------------------------------------------------------------------------------------------------
# Tiny model for correctness and FLOPs: L=4, d=32, 2 heads, T=16, B=2.
# ----------------------------------------------------------------------------------------------------

L, C, H, T, B, V = 4, 32, 2, 16, 2, 64
D = C // H


def tiny(attention: str, dropout: float, **kw: Any) -> GPTConfig:
    return GPTConfig(
        vocab_size=V, block_size=T, n_layer=L, n_embd=C, n_head=H, dropout=dropout, attention=attention, **kw
    )


@functools.cache
def base_model(attention: str, dropout: float) -> GPT:
    torch.manual_seed(0)
    return GPT(tiny(attention, dropout))


def with_policy(attention: str, dropout: float, case: str) -> GPT:
    model = copy.deepcopy(base_model(attention, dropout))  # same init for every policy
    apply_policy(model, CASES[case])
    return model


@functools.cache
def micro_batches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (2, B, T), generator=g), torch.randint(0, V, (2, B, T), generator=g)


def train_step(model: GPT, accum: int, bf16: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """One optimizer step's worth of backward: `accum` micro-batches, each loss / accum, summed into .grad."""
    idx, tgt = micro_batches()
    model.train()
    model.zero_grad(set_to_none=True)
    losses = []
    for i in range(accum):
        torch.manual_seed(1000 + i)  # same dropout masks for every policy
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(idx[i], tgt[i])
        (loss / accum).backward()
        losses.append(loss.detach())
    grads = {}
    for n, p in model.named_parameters():  # tied lm_head/wte weight appears once
        assert p.grad is not None, n
        grads[n] = p.grad.clone()
    return losses, grads


@functools.cache
def reference(attention: str, dropout: float, accum: int, bf16: bool) -> Any:
    return train_step(with_policy(attention, dropout, "none"), accum, bf16)


# Every case that changes how the step runs: the trivial ones (no-op offload on CPU, selective under SDPA) would
# compare `none` with itself, so they are left out of the count of real comparisons.
MATRIX = [
    (case, precision, accum, dropout, attention)
    for case in NOT_NONE
    for precision in ("32-true", "bf16-mixed")
    for accum in (1, 2)
    for dropout in (0.0, 0.1)
    for attention in ("sdpa", "eager")
    if trivial(case, attention) is None
]


@pytest.mark.parametrize("case, precision, accum, dropout, attention", MATRIX)
def test_loss_and_every_gradient_equal_none_bitwise(
    case: str, precision: str, accum: int, dropout: float, attention: str
) -> None:
    bf16 = precision == "bf16-mixed"
    ref_losses, ref_grads = reference(attention, dropout, accum, bf16)
    losses, grads = train_step(with_policy(attention, dropout, case), accum, bf16)
    assert len(losses) == accum
    for got, want in zip(losses, ref_losses, strict=True):
        assert torch.equal(got, want), f"loss {got.item()!r} != {want.item()!r}"
    assert grads.keys() == ref_grads.keys()
    differ = {n: (grads[n] - ref_grads[n]).abs().max().item() for n in grads if not torch.equal(grads[n], ref_grads[n])}
    assert not differ, f"gradients differ from none (max abs diff per parameter): {differ}"


# ----------------------------------------------------------------------------------------------------
# Every family behind the decoder contract: LLaMA (GQA, rotary context) and Hugging Face Llama and GPT-2
# (fp32, dropout where the model has it, eager attention so selective recomputes, accum 2).
# ----------------------------------------------------------------------------------------------------

# jamba: a hybrid, half its layers without attention; opt: layers one level down; cohere: a logit scale before the
# loss; gpt_neo and bloom (and falcon before transformers 5.25): attention inline (no seam, so selective is refused)
# and layers returning a tuple whose first element the loop reads (so groups hand on a stand-in tuple)
# The native families come from the registry (each at its test size, L layers, dropout on), so a new one is in.
FAMILIES = (
    *NATIVE_FAMILIES,
    "hf-llama",
    "hf-gpt2",
    "hf-jamba",
    "hf-opt",
    "hf-cohere",
    "hf-falcon",
    "hf-gpt_neo",
    "hf-bloom",
)
_family_models: dict[str, Any] = {}


def family_model(family: str, hf_models: dict[str, Any]) -> Any:
    if family not in _family_models:
        torch.manual_seed(0)
        if family in NATIVE_FAMILIES:
            from models import FAMILIES as REGISTRY
            from models import build_model
            from trainer.core.schema import compose_config

            shape = [
                f"model.vocab_size={V}",
                f"model.block_size={T}",
                f"model.n_layer={L}",
                "model.dropout=0.1",
                "model.attention=eager",
                f"seq_len={T}",
            ]
            _family_models[family] = build_model(compose_config([*REGISTRY[family].tiny_overrides, *shape]).model)
        else:
            from models.hf import load_causal_lm

            _family_models[family] = load_causal_lm(str(hf_models[family.split("-")[1]]), attention="eager")
    return copy.deepcopy(_family_models[family])


def family_step(model: Any, accum: int = 2) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    from trainer.loss import LossConfig, head_loss

    adapter = adapter_for(model)
    vocab = adapter.head.weight.shape[0]
    g = torch.Generator().manual_seed(1)
    idx, tgt = torch.randint(0, vocab, (accum, B, T), generator=g), torch.randint(0, vocab, (accum, B, T), generator=g)
    model.train()
    losses = []
    for i in range(accum):
        torch.manual_seed(1000 + i)
        loss = head_loss(adapter.hidden(idx[i]), adapter.head, tgt[i], LossConfig(), adapter.logit_transform)
        (loss / accum).backward()
        losses.append(loss.detach())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", [c for c in NOT_NONE if trivial(c, "eager") is None])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_every_policy_equals_none_bitwise(family: str, case: str, hf_models: dict[str, Any]) -> None:
    ref = family_step(family_model(family, hf_models))
    model = family_model(family, hf_models)
    policy = build_policy(CASES[case])
    if not adapter_for(model).has_attention_seam and any(
        policy.treatment_policy(t).caps.recomputes_core for t in policy.plan(adapter_for(model).n_layer).treatments
    ):
        with pytest.raises(PolicyError, match="has no swappable attention function"):
            apply_policy(model, policy)
        return
    apply_policy(model, policy)
    assert installed(model)
    # falcon's inline attention (transformers < 5.25) divides its scores by √d in place after a saved bmm
    if case == "torchtitan_sac" and family == "hf-falcon" and not adapter_for(model).has_attention_seam:
        with pytest.raises(PolicyError, match=r"writes in place \(aten.div_.Tensor\) into the output"):
            family_step(model)
        return
    losses, grads = family_step(model)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref[0], strict=True)), (losses, ref[0])
    assert grads.keys() == ref[1].keys() and len(grads) == len(list(model.parameters()))
    differ = [n for n in grads if not torch.equal(grads[n], ref[1][n])]
    assert not differ, f"{family} under {case}: gradients differ from none in {differ[:3]}"


def test_layers_that_hand_more_than_the_hidden_states_on_refuse_grouping(hf_models: dict[str, Any]) -> None:
    """Zaya's layers return (hidden, router state) and the next layer reads the router state: a group's earlier
    layers cannot pass the stream through, so every_k and sqrt are refused in one line; per-layer policies run."""
    model = family_model("hf-zaya", hf_models)
    ref = family_step(copy.deepcopy(model))
    apply_policy(model, "full")
    for grouped in ("sqrt", {"name": "every_k", "k": 2}):
        with pytest.raises(PolicyError, match=r"hands each layer more than the hidden states.*choose full") as e:
            apply_policy(model, grouped)
        assert "\n" not in str(e.value)
        assert model.activation_policy.cfg.name == "full"  # the installed one stays
    losses, grads = family_step(model)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref[0], strict=True))
    assert all(torch.equal(grads[n], ref[1][n]) for n in ref[1])


def test_a_group_recomputes_what_its_layers_saved(hf_models: dict[str, Any]) -> None:
    """A grouped checkpoint on an HF model really is one region: it keeps only the group's input."""

    def peak(policy: str) -> int:
        model = family_model("hf-llama", hf_models)
        apply_policy(model, policy)
        with LiveTensorTracker() as t:
            family_step(model, accum=1)
        return t.peak_bytes_excluding([p.grad for p in model.parameters()])

    assert peak("sqrt") < peak("selective") < peak("none")


# ----------------------------------------------------------------------------------------------------
# state_dict and reversibility
# ----------------------------------------------------------------------------------------------------


def _loss(model: GPT) -> torch.Tensor:
    idx, tgt = micro_batches()
    model.train()
    torch.manual_seed(7)
    return model(idx[0], tgt[0])[1]


@pytest.mark.parametrize("case", NOT_NONE)
def test_state_dict_keys_and_values_unchanged_under_every_policy(case: str) -> None:
    plain = base_model("eager", 0.1).state_dict()
    sd = with_policy("eager", 0.1, case).state_dict()
    assert list(sd) == list(plain)
    assert all(torch.equal(sd[k], plain[k]) for k in plain)


@pytest.mark.parametrize("saved_under, loaded_under", [("none", "full"), ("full", "none")])
def test_checkpoint_moves_between_policies(saved_under: str, loaded_under: str) -> None:
    trained = with_policy("eager", 0.1, saved_under)
    with torch.no_grad():  # make the weights differ from any fresh init
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    buf = io.BytesIO()
    torch.save(trained.state_dict(), buf)
    buf.seek(0)
    torch.manual_seed(123)
    fresh = GPT(tiny("eager", 0.1))
    apply_policy(fresh, loaded_under)
    fresh.load_state_dict(torch.load(buf, weights_only=True), strict=True)
    assert torch.equal(_loss(fresh), _loss(trained))


def _step_flops(model: GPT) -> int:
    idx, tgt = micro_batches()
    return count_flops(lambda: model(idx[0], tgt[0])[1].backward())


def test_apply_twice_replaces_and_remove_restores_the_plain_model() -> None:
    plain = copy.deepcopy(base_model("eager", 0.0))
    want_flops = _step_flops(plain)
    _, want_grads = train_step(plain, 1, False)
    selective_once = with_policy("eager", 0.0, "selective")

    model = copy.deepcopy(base_model("eager", 0.0))
    apply_policy(model, "full")
    apply_policy(model, "selective")
    apply_policy(model, "selective")
    # The second and third apply replaced the first: no nested checkpoint (that would recompute twice).
    assert not any("forward" in layer.__dict__ for layer in model.layers)  # selective leaves the layers' calls alone
    assert model.activation_plan.describe() == "[0-3]:selective"
    assert _step_flops(model) == _step_flops(selective_once) > want_flops

    remove_policy(model)
    assert not installed(model)
    assert not hasattr(model, "activation_policy") and not hasattr(model, "activation_plan")
    assert _step_flops(model) == want_flops
    _, grads = train_step(model, 1, False)
    assert all(torch.equal(grads[n], want_grads[n]) for n in want_grads)


def test_a_refused_policy_leaves_the_installed_one_in_place() -> None:
    model = with_policy("eager", 0.0, "full")
    with pytest.raises(PolicyError):
        apply_policy(model, {"name": "every_k", "k": 99})
    assert model.activation_plan.describe() == "[0-3]:full"
    assert installed(model)


@pytest.mark.parametrize(
    "case, eager, sdpa",
    [
        ("none", "[0-3]:none", "[0-3]:none"),
        ("full", "[0-3]:full", "[0-3]:full"),
        ("selective", "[0-3]:selective", "[0-3]:none"),  # nothing recomputed with sdpa: say so
        ("sqrt", "[0-1]:full-group [2-3]:full-group", None),
        ("every_k2", "[0-1]:full-group [2-3]:full-group", None),
        ("first_k1", "[0]:full [1-3]:none", None),
        ("op_sac", "[0-3]:op_sac", None),
        ("torchtitan_sac", "[0-3]:torchtitan_sac", None),
        ("torchtitan_sac_02", "[0-3]:torchtitan_sac", None),
        ("offload", "[0-3]:offload", None),
        ("per_block_pattern", "[0]:full [1]:selective [2]:none [3]:op_sac", "[0]:full [1-2]:none [3]:op_sac"),
        ("per_block_blocks", "[0]:offload [1]:full [2]:selective [3]:none", "[0]:offload [1]:full [2-3]:none"),
    ],
)
def test_describe_is_truthful_per_block(case: str, eager: str, sdpa: str | None) -> None:
    assert with_policy("eager", 0.0, case).activation_plan.describe() == eager
    assert with_policy("sdpa", 0.0, case).activation_plan.describe() == (sdpa or eager)


def test_describe_keeps_adjacent_groups_apart_and_a_lone_tail_per_block() -> None:
    model = copy.deepcopy(base_model("eager", 0.0))
    apply_policy(model, {"name": "every_k", "k": 3})
    assert model.activation_plan.describe() == "[0-2]:full-group [3]:full"


# ----------------------------------------------------------------------------------------------------
# FLOPs: exact integers (32-true, dropout 0, one forward + backward)
# ----------------------------------------------------------------------------------------------------


@functools.cache
def flop_parts(attention: str) -> dict[str, Any]:
    """The pieces a policy can recompute, each counted on its own."""
    model = base_model(attention, 0.0)
    torch.manual_seed(2)
    x = torch.randn(B, T, C)
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    blocks = [count_flops(lambda b=b: b(x)) for b in model.layers]
    attn = model.layers[0].attn
    parts = {
        "block": blocks,  # one forward of each block
        "last": count_flops(lambda: model.layers[0].mlp.c_proj(torch.randn(B, T, 4 * C))),  # the op early stop skips
        "qk": count_flops(lambda: q @ k.transpose(-2, -1)),
        "core": count_flops(lambda: type(attn).core_attention(attn, q, k, v)),
    }
    # QKᵀ and ·V: 2·B·H·T²·D each, causality not discounted.
    assert parts["qk"] == 2 * B * H * T * T * D
    assert parts["core"] == 2 * parts["qk"]
    return parts


def expected_extra_flops(case: str, attention: str, early_stop: bool) -> int:
    p = flop_parts(attention)
    skip = p["last"] if early_stop else 0

    def group(*blocks: int) -> int:  # one checkpoint over these blocks: a forward of each, minus early stop
        return sum(p["block"][i] for i in blocks) - skip

    eager = attention == "eager"
    # selective's region ends with ·V, whose output nobody inside saves: early stop skips it, leaving QKᵀ.
    selective = (p["qk"] if early_stop else p["core"]) if eager else 0
    # op_sac saves mm/addmm/SDPA outputs and recomputes the rest: with eager attention the two bmm matmuls of
    # the core (not in the save list). ·V is needed again here: its output feeds the recomputed contiguous copy
    # that c_proj saves. The MLP's c_proj (addmm) is cached, so early stop changes nothing.
    op_sac = p["core"] if eager else 0
    # torchtitan's per-op policy (0.3) saves the partitioner's compute-intensive ops, bmm and addmm among them, but
    # not CPU's SDPA kernel (_scaled_dot_product_flash_attention_for_cpu), which is recomputed once per block; its
    # every-second-matmul rule counts aten.mm and aten.linear, which a GPT block with biases never dispatches.
    # 0.2's list names aten.mm alone, so a GPT block's addmm are all recomputed: the same as full.
    torchtitan = 0 if eager else p["core"]
    return {
        "none": 0,
        "offload": 0,  # no recompute; on CPU not even a copy
        "full": sum(group(i) for i in range(L)),
        "selective": L * selective,
        "sqrt": group(0, 1) + group(2, 3),  # ⌈√4⌉ = 2 groups of 2
        "every_k2": group(0, 1) + group(2, 3),
        "first_k1": group(0),
        "first_k2": group(0) + group(1),
        "op_sac": L * op_sac,
        "torchtitan_sac": L * torchtitan,
        "torchtitan_sac_02": sum(group(i) for i in range(L)),
        "per_block_pattern": group(0) + selective + 0 + op_sac,  # [full, selective, none, op_sac]
        "per_block_blocks": 0 + group(1) + selective + 0,  # [offload, full, selective, none]
    }[case]


@pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "no_early_stop"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_recompute_flops_are_exactly_what_each_plan_implies(attention: str, early_stop: bool) -> None:
    with set_checkpoint_early_stop(early_stop):
        base = _step_flops(with_policy(attention, 0.0, "none"))
        got = {case: _step_flops(with_policy(attention, 0.0, case)) - base for case in CASES}
    want = {case: expected_extra_flops(case, attention, early_stop) for case in CASES}
    assert got == want
    p = flop_parts(attention)
    if not early_stop:  # the textbook statements, literally
        assert got["full"] == sum(p["block"])
        assert got["selective"] == (L * p["core"] if attention == "eager" else 0)
    else:  # what torch actually does by default: the last op of every checkpointed region is not replayed
        assert got["full"] == sum(p["block"]) - L * p["last"]


def test_with_dropout_early_stop_still_replays_the_whole_block() -> None:
    # With dropout on, the block ends in a dropout whose noise tensor is saved; regenerating it means running
    # mlp.c_proj first, so `full` adds exactly one forward of every block even with early stop.
    parts = flop_parts("eager")
    base = _step_flops(with_policy("eager", 0.1, "none"))
    assert _step_flops(with_policy("eager", 0.1, "full")) - base == sum(parts["block"])
    assert _step_flops(with_policy("eager", 0.1, "sqrt")) - base == sum(parts["block"])


# ----------------------------------------------------------------------------------------------------
# Memory: activation peak with the live-tensor tracker (eager attention, dropout 0.1)
# Shape: L=4, d=48, 2 heads, T=80, B=2, vocab 64. Chosen so a T×T tensor (B·H·T² elements) is no simple
# multiple of a (B, T, d) one, and a block's internals are ~17-28× its input.
# ----------------------------------------------------------------------------------------------------

ML, MC, MH, MT, MB, MV = 4, 48, 2, 80, 2, 64
MN = MB * MT  # tokens
X = MN * MC * F32  # one residual-stream tensor (a block input): fp32 in both precisions


@functools.cache
def mem_base() -> GPT:
    torch.manual_seed(0)
    return GPT(
        GPTConfig(vocab_size=MV, block_size=MT, n_layer=ML, n_embd=MC, n_head=MH, dropout=0.1, attention="eager")
    )


@functools.cache
def mem_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, MV, (MB, MT), generator=g), torch.randint(0, MV, (MB, MT), generator=g)


@functools.cache
def measure(case: str, bf16: bool) -> tuple[int, int]:
    """(live bytes at the end of forward, activation peak over forward + backward = peak excluding grads)."""
    model = copy.deepcopy(mem_base())
    model.zero_grad(set_to_none=True)  # .grad created inside the window is what peak_bytes_excluding drops
    apply_policy(model, CASES[case])
    idx, tgt = mem_batch()
    torch.manual_seed(1)
    with LiveTensorTracker() as t:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(idx, tgt)[1]  # logits dropped: log_softmax keeps its own output
        end_of_forward = t.live_bytes
        loss.backward()
    return end_of_forward, t.peak_bytes_excluding([p.grad for p in model.parameters()])


@functools.cache
def one_block(bf16: bool) -> tuple[int, int]:
    """One block alone, no policy: (bytes it keeps after its forward incl. its output, its fwd+bwd peak)."""
    block = copy.deepcopy(mem_base().layers[0])  # its .grad must not leak into the shared model
    x = torch.randn(MB, MT, MC, requires_grad=True)
    torch.manual_seed(1)
    with LiveTensorTracker() as t:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = block(x)
        kept = t.live_bytes
        y.backward(torch.ones_like(y))
    return kept, t.peak_bytes_excluding([x.grad] + [p.grad for p in block.parameters()])


def test_one_block_keeps_what_the_code_says_fp32() -> None:
    # Saved by a block (fp32, eager, CPU dropout keeps a scaled noise tensor in the input dtype), in (N, d) units:
    # ln_1 out 1, q/kᵀ/v contiguous copies for the bmm's 3, ·V output made contiguous 1, attention-out dropout
    # noise 1, residual 1, ln_2 out 1, c_fc out 4 + GELU out 4, MLP dropout noise 1, block output 1 = 18;
    # plus LayerNorm mean/rstd (2 per token per LN), the inverted causal mask (T² bools) and three (B,H,T,T)
    # tensors: softmax output, dropout noise, dropout output.
    tt = MB * MH * MT * MT * F32
    kept, _ = one_block(False)
    assert kept == 18 * X + 2 * 2 * MN * F32 + MT * MT + 3 * tt
    assert kept > 28 * X  # the internals dwarf the input


def head_bytes(bf16: bool) -> int:
    """What the model keeps outside its blocks after the forward (the loss head and the embedding)."""
    # The embedding dropout's noise, the last block's output (ln_f's input), ln_f's mean/rstd, log_softmax's
    # output (fp32), the position ids (int64) and the two scalars nll_loss returns.
    common = X + X + 2 * MN * F32 + MN * MV * F32 + MT * 8 + 2 * F32
    if bf16:  # lm_head runs in bf16: it keeps bf16 copies of ln_f's output and of the tied weight
        return common + MN * MC * BF16 + MV * MC * BF16
    return common + X  # ln_f's fp32 output


def full_peak_bounds(bf16: bool) -> tuple[int, int]:
    # During backward one block at a time is recomputed: the peak is the L stored inputs plus one block's
    # internals — at least what a block keeps after its forward, at most one block's whole fwd+bwd working
    # set — plus, at most, the head.
    kept, block_peak = one_block(bf16)
    return ML * X + kept, ML * X + block_peak + head_bytes(bf16)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_full_keeps_only_block_inputs_and_the_head(precision: str) -> None:
    bf16 = precision == "bf16-mixed"
    end_of_forward, peak = measure("full", bf16)
    # After the forward `full` keeps the L block inputs (the first is the embedding dropout's output) and the head.
    assert end_of_forward == ML * X + head_bytes(bf16)
    low, high = full_peak_bounds(bf16)
    assert low <= peak <= high
    assert peak < measure("none", bf16)[1] / 2


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_selective_keeps_no_score_tensors(precision: str) -> None:
    bf16 = precision == "bf16-mixed"
    s = BF16 if bf16 else F32  # the scores follow the matmul's dtype; CPU autocast leaves softmax in bf16
    tt = MB * MH * MT * MT * s
    none_end, none_peak = measure("none", bf16)
    sel_end, sel_peak = measure("selective", bf16)
    # Per layer `none` keeps three (B,H,T,T) tensors (softmax output, dropout noise, dropout output) and the
    # inverted causal mask; `selective` keeps none of them. Its checkpoint keeps q, k, v, views of the qkv
    # output (3 (N,d) tensors) where `none` keeps the three contiguous copies the bmm's save: the same bytes.
    assert none_end - sel_end == ML * (3 * tt + MT * MT)
    # In backward `selective` brings one layer's scores back at a time.
    assert none_peak - sel_peak >= (ML - 1) * 3 * tt


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_orderings_theory_predicts(precision: str) -> None:
    bf16 = precision == "bf16-mixed"
    peak = {case: measure(case, bf16)[1] for case in ("none", "selective", "op_sac", "full", "offload")}
    assert peak["none"] > peak["selective"] > peak["full"]
    assert peak["none"] > peak["op_sac"] > peak["full"]
    # On CPU there is no device to offload from: exactly the same bytes as `none`.
    assert measure("offload", bf16) == measure("none", bf16)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_sqrt_peaks_above_full_because_a_block_dwarfs_its_input(precision: str) -> None:
    bf16 = precision == "bf16-mixed"
    kept, _ = one_block(bf16)
    _, full_peak = measure("full", bf16)
    _, sqrt_peak = measure("sqrt", bf16)
    # sqrt on L=4: 2 groups of 2. Recomputing a group holds both blocks' internals; full holds one block's
    # internals but all L inputs. sqrt loses as soon as one block keeps more than (L - L/g) inputs' worth.
    assert kept > (ML - ML // 2) * X
    sqrt_low = ML // 2 * X + 2 * kept  # 2 group inputs + a whole group's internals during its recompute
    assert sqrt_peak >= sqrt_low > full_peak_bounds(bf16)[1] >= full_peak  # above anything full can reach
    assert measure("every_k2", bf16) == measure("sqrt", bf16)  # the same plan


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: offload copies only from there")
def test_offload_on_cuda_empties_the_device_and_overlaps_copies(tmp_path: Any) -> None:
    from torch.profiler import ProfilerActivity, profile

    cfg = GPTConfig(vocab_size=256, block_size=256, n_layer=12, n_embd=256, n_head=4, dropout=0.0, attention="eager")
    torch.manual_seed(0)
    base = GPT(cfg).cuda()
    idx = torch.randint(0, 256, (8, 256), device="cuda")
    tgt = torch.randint(0, 256, (8, 256), device="cuda")
    plain, off = copy.deepcopy(base), copy.deepcopy(base)
    policy = apply_policy(off, "offload")

    def step(model: GPT) -> tuple[int, int, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        with LiveTensorTracker(device="cuda") as t:
            loss = model(idx, tgt)[1]
            end_of_forward = t.live_bytes
            loss.backward()
        torch.cuda.synchronize()
        peak = t.peak_bytes_excluding([p.grad for p in model.parameters()])
        return end_of_forward, peak, {n: p.grad.clone() for n, p in model.named_parameters()}

    for m in (plain, off):  # warm-up: cuBLAS handles, side streams, pinned pool
        step(m)
    none_end, none_peak, none_grads = step(plain)
    off_end, off_peak, off_grads = step(off)
    assert policy.offloader.bytes_offloaded > 0
    kt = torch.randn(8, 64, 64, device="cuda").transpose(1, 2)  # not contiguous, 128 KiB (above min_bytes)
    packed = policy.offloader._pack(0, kt)
    assert packed.host.stride() == kt.stride()
    assert policy.offloader._unpack(0, packed).stride() == kt.stride()
    # Same kernels on the same values; a tolerance only because some CUDA backward kernels use atomics.
    for n in none_grads:
        torch.testing.assert_close(off_grads[n], none_grads[n], rtol=1e-5, atol=1e-6)
    # After the forward only the head (not offloaded) and tensors under min_bytes stay on the device.
    assert off_end <= 0.1 * none_end, (off_end, none_end)
    # In backward a block and its prefetched predecessor come back at a time, out of 12.
    assert off_peak <= 0.5 * none_peak, (off_peak, none_peak)

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loss = off(idx, tgt)[1]
        loss.backward()
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [
        e
        for e in events
        if e.get("cat") == "gpu_memcpy"
        and ("DtoH" in e["name"] or "HtoD" in e["name"])
        and e.get("args", {}).get("bytes", 0) >= policy.cfg.min_bytes
    ]
    assert any("DtoH" in e["name"] for e in copies) and any("HtoD" in e["name"] for e in copies)
    compute_streams = {e["args"]["stream"] for e in kernels}
    assert not {e["args"]["stream"] for e in copies} & compute_streams, "offload copies ran on a compute stream"

    def overlaps(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]

    assert any(overlaps(c, k) for c in copies for k in kernels), "no copy overlapped any kernel"


# ----------------------------------------------------------------------------------------------------
# Bad input: one clear line each
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg, words",
    [
        ("nope", ["unknown policy 'nope'", "every_k", "per_block"]),
        ({"name": "every_k", "k": 0}, ["policy.k=0", "between 1 and model.n_layer=4"]),
        ({"name": "every_k", "k": 5}, ["policy.k=5", "between 1 and model.n_layer=4"]),
        ({"name": "first_k", "k": 0}, ["policy.k=0", "between 1 and model.n_layer=4"]),
        ({"name": "first_k", "k": 5}, ["policy.k=5", "between 1 and model.n_layer=4"]),
        ({"name": "per_block", "blocks": ["full"] * 3}, ["3 entries", "4 blocks"]),
        ({"name": "per_block", "blocks": ["full", "fulll", "none", "none"]}, ["unknown treatment 'fulll'", "offload"]),
        ({"name": "per_block", "pattern": ["bogus"]}, ["unknown treatment 'bogus'", "policy.pattern"]),
        ({"name": "per_block"}, ["give policy.blocks=[...]", "policy.pattern=[...]"]),
        ({"name": "op_sac", "save_ops": ["aten.nosuchop"]}, ["unknown op 'aten.nosuchop'", "aten.mm"]),
        ({"name": "op_sac", "save_ops": ["mm"]}, ["unknown op 'mm'"]),
        ({"name": "full", "k": 3}, ["policy.k", "not in"]),
        (
            {"name": "per_block", "pattern": ["op_sac"], "params": {"op_sac": {"save_ops": ["aten.nosuchop"]}}},
            ["policy.params.op_sac.save_ops", "unknown op 'aten.nosuchop'"],
        ),
        (
            {"name": "per_block", "pattern": ["full"], "params": {"fulll": {}}},
            ["policy.params.fulll", "not a treatment"],
        ),
        (  # the key of before, moved: the line says where it goes now
            {"name": "per_block", "pattern": ["op_sac"], "save_ops": ["aten.mm"]},
            ["policy.save_ops", "give policy.params.op_sac.save_ops"],
        ),
        (
            {"name": "per_block", "pattern": ["full"], "params": {"offload": {"min_bytes": -1}}},
            ["policy.params.offload.min_bytes=-1"],
        ),
    ],
)
def test_bad_input_is_one_clear_line(cfg: Any, words: list[str]) -> None:
    model = copy.deepcopy(base_model("eager", 0.0))
    with pytest.raises(PolicyError) as e:
        apply_policy(model, cfg)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg
    assert not installed(model)  # nothing installed


def _notices(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == policies.__name__]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-op notice is for machines without CUDA")
def test_offload_without_cuda_says_no_op_once(caplog: pytest.LogCaptureFixture) -> None:
    model = copy.deepcopy(base_model("eager", 0.0))
    with caplog.at_level(logging.WARNING, logger=policies.__name__):
        apply_policy(model, "offload")
        apply_policy(model, "offload")
        apply_policy(model, {"name": "per_block", "blocks": ["offload"] * 4})
        train_step(model, 1, False)
    said = _notices(caplog)
    assert len(said) == 1 and "\n" not in said[0]
    assert "without a CUDA device" in said[0] and "no-op" in said[0]


def test_selective_with_sdpa_says_what_it_does_once(caplog: pytest.LogCaptureFixture) -> None:
    model = copy.deepcopy(base_model("sdpa", 0.0))
    with caplog.at_level(logging.WARNING, logger=policies.__name__):
        apply_policy(model, "selective")
        apply_policy(model, "selective")
        apply_policy(model, {"name": "per_block", "pattern": ["selective", "full"]})
    said = _notices(caplog)
    assert len(said) == 1 and "\n" not in said[0]
    assert "model.attention=sdpa" in said[0] and "model.attention=eager" in said[0]
    # and with eager attention there is nothing to say
    caplog.clear()
    policies.base._said.clear()
    with caplog.at_level(logging.WARNING, logger=policies.__name__):
        apply_policy(copy.deepcopy(base_model("eager", 0.0)), "selective")
    assert _notices(caplog) == []


def test_build_policy_accepts_a_name_a_dict_and_a_config_object() -> None:
    assert build_policy("full").name == "full"
    assert build_policy({"name": "every_k", "k": 3}).cfg.k == 3
    assert build_policy(POLICIES["first_k"].Config(name="first_k", k=1)).cfg.k == 1


def test_per_block_blocks_override_the_default_pattern() -> None:
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32))
    apply_policy(model, {"name": "per_block", "pattern": ["full", "none"], "blocks": ["none", "none", "full", "full"]})
    assert model.activation_plan.describe() == "[0-1]:none [2-3]:full"


# ----------------------------------------------------------------------------------------------------
# The seams: a treatment's parameters, the schema each yaml extends, the callbacks a policy brings.
# ----------------------------------------------------------------------------------------------------


def _scaled_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    s = q @ k.transpose(-1, -2)  # 4-D: bmm, its output returned through aten._unsafe_view
    s /= 2.0  # in place, as Falcon scales its scores
    return torch.softmax(s, -1) @ q


def test_torch_sac_hands_back_a_saved_output_mutated_in_place_and_torchtitan_sac_refuses() -> None:
    """Why the guard exists: torch's SAC, told to save bmm, returns in the recompute the output as the in-place
    division left it, and its version check does not see the write, so the gradients are silently wrong. The
    day this torch is fixed, the first assertion fails and the guard can go. torchtitan_sac saves bmm: refused."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    def save_bmm(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if func is torch.ops.aten.bmm.default else CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    q, k = (torch.randn(2, 3, 4, 5, requires_grad=True) for _ in range(2))
    want = torch.autograd.grad(_scaled_scores(q, k).sum(), q)[0]
    out = checkpointed(_scaled_scores, q, k, context_fn=lambda: create_selective_checkpoint_contexts(save_bmm))
    assert not torch.allclose(torch.autograd.grad(out.sum(), q)[0], want)
    policy = build_policy({"name": "torchtitan_sac"})
    with pytest.raises(PolicyError, match=r"policy=torchtitan_sac: this model writes in place \(aten.div_.Tensor\)"):
        policy.run(lambda h: _scaled_scores(h, k), q, 0)
    mine = build_policy({"name": "op_sac", "save_ops": ["aten.mm", "aten.bmm"]})  # the user's own list: guarded too
    with pytest.raises(PolicyError, match=r"policy=op_sac: this model writes in place"):
        mine.run(lambda h: _scaled_scores(h, k), q, 0)
    policy_02 = build_policy({"name": "torchtitan_sac", "version": "0.2"})  # saves mm, not bmm: exact here
    got = torch.autograd.grad(policy_02.run(lambda h: _scaled_scores(h, k), q, 0).sum(), q)[0]
    assert torch.equal(got, want)


def test_a_treatments_parameters_reach_it_through_a_composite_policy() -> None:
    from trainer.core.schema import compose_config

    params = ["policy.params.op_sac.save_ops=[aten.addmm]", "policy.params.offload.prefetch=false"]
    config = compose_config(["policy=per_block", "policy.pattern=[op_sac,offload]", *params])
    policy = build_policy(config.policy)
    assert policy.treatment_policy("op_sac").cfg.save_ops == ["aten.addmm"]
    assert policy.treatment_policy("offload").cfg.prefetch is False
    # every treatment with parameters is listed under params, from its own Config (the registry, not a hand list)
    auto = compose_config(["policy=auto", "policy.budget_mib=100"]).policy
    with_params = {n for n, c in POLICIES.items() if c.caps.treatment and len(dataclasses.fields(c.Config)) > 1}
    assert set(auto["params"]) == with_params and {"op_sac", "offload"} <= with_params
    assert list(auto["params"]["op_sac"]["save_ops"]) == list(DEFAULT_SAC_SAVE_OPS)
    # the old spelling on the command line is one line naming the new one
    from trainer.core.schema import describe_user_error

    with pytest.raises(Exception) as e:
        compose_config(["policy=auto", "policy.budget_mib=100", "policy.save_ops=[aten.mm]"])
    assert "policy.params.op_sac.save_ops" in (describe_user_error(e.value) or "")
    # and a policy's own parameter stays where it was
    assert build_policy(compose_config(["policy=op_sac", "policy.save_ops=[aten.mm]"]).policy).cfg.save_ops == [
        "aten.mm"
    ]


def test_policy_yaml_repeats_no_default() -> None:
    from omegaconf import OmegaConf

    from tests.conftest import CONF

    for name, cls in POLICIES.items():
        node = OmegaConf.load(CONF / "policy" / f"{name}.yaml")
        assert list(node.pop("defaults")) == [f"/policy_schema/{name}@_here_", "_self_"], name
        schema = config_node(cls)
        for key, value in node.items():
            assert key in schema and value != schema[key], f"conf/policy/{name}.yaml repeats {key}={value}"


def test_a_policy_brings_its_callbacks() -> None:
    """A policy names the callbacks it needs (`brings`); nothing has to be imported first for them to be found."""
    auto = build_policy({"name": "auto", "budget_mib": 100})
    (planner,) = auto.callbacks()
    from callbacks.planner import AutoPlanCallback

    assert isinstance(planner, AutoPlanCallback) and planner.policy is auto and auto.callbacks() == [planner]
    assert auto.caps.planned_first and auto.caps.unplanned
    assert all(build_policy(CASES[c]).callbacks() == [] for c in CASES)
    with pytest.raises(PolicyError, match="is not planned"):
        build_policy("full").choose(["none"])


def test_a_new_treatment_with_a_parameter_is_one_class() -> None:
    """What the README's extending table says: a treatment registers with its Config, and per_block and auto take
    its parameter under policy.params.<name> (in their schema, validated, handed to its blocks) with no other edit."""
    from trainer.policies import Capabilities, PolicyConfig, register

    @dataclasses.dataclass
    class ScaledConfig(PolicyConfig):
        factor: float = 1.0

        def __post_init__(self) -> None:
            if self.factor <= 0:
                raise ValueError(f"policy.factor={self.factor} must be > 0")

    @register
    class Scaled(policies.Policy):
        name = "scaled_test"
        caps = Capabilities(treatment=True)
        Config = ScaledConfig

        def run(self, fn: Any, x: torch.Tensor, key: int) -> torch.Tensor:
            return fn(x * self.cfg.factor) / self.cfg.factor if self.cfg.factor != 1.0 else fn(x)

    try:
        assert config_node(POLICIES["per_block"]).params["scaled_test"] == {"factor": 1.0}
        assert "scaled_test" in config_node(POLICIES["auto"]).params
        policy = build_policy(
            {"name": "per_block", "pattern": ["scaled_test"], "params": {"scaled_test": {"factor": 2}}}
        )
        assert policy.treatment_policy("scaled_test").cfg.factor == 2.0
        with pytest.raises(PolicyError, match="policy.params.scaled_test.factor=-1"):
            build_policy({"name": "per_block", "pattern": ["none"], "params": {"scaled_test": {"factor": -1}}})
        model = copy.deepcopy(base_model("eager", 0.0))
        apply_policy(model, policy)
        assert model.activation_plan.describe() == "[0-3]:scaled_test"
    finally:
        POLICIES.pop("scaled_test")


def test_a_save_list_name_this_torch_lacks_is_said_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchtitan's save lists name ops some torch versions lack; they are skipped as torchtitan skips them, and each
    skipped name is logged once per process, not dropped without a word."""
    import logging

    from trainer.policies import library

    monkeypatch.setattr(library, "_MISSING", set())
    with caplog.at_level(logging.INFO, logger="trainer.policies.library"):
        found = library._ops("aten.mm.default", "aten.no_such_op.default", "hop.no_such_hop")
        library._ops("aten.no_such_op.default")
    assert found == frozenset({torch.ops.aten.mm.default})
    lines = [r.getMessage() for r in caplog.records if r.name == "trainer.policies.library"]
    assert len(lines) == 2, lines
    assert "aten.no_such_op.default" in lines[0] and "hop.no_such_hop" in lines[1]
    assert all(line.endswith("lacks: not saved") for line in lines)
