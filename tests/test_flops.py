"""FLOP counts, exact: Linear by the 2·n·in·out rule, CPU fused attention by torch's own SDPA formulas."""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import flop_counter as torch_flop_counter

import trainer.measure.time.flops
from trainer.measure.time.flops import count_flops, flop_counter


def test_linear_forward_and_backward() -> None:
    n, a, b = 8, 16, 24
    torch.manual_seed(0)
    layer = nn.Linear(a, b)
    x = torch.randn(n, a, requires_grad=True)
    assert count_flops(lambda: layer(x)) == 2 * n * a * b
    # Backward adds the input grad (grad_out @ W) and the weight grad (grad_out^T @ x), each 2·n·a·b;
    # the bias grad is a reduction, not counted.
    assert count_flops(lambda: layer(x).sum().backward()) == 6 * n * a * b


def test_cpu_sdpa_forward_and_backward_are_counted() -> None:
    bsz, heads, seq, hd = 2, 3, 16, 8
    torch.manual_seed(0)
    q, k, v = (torch.randn(bsz, heads, seq, hd, requires_grad=True) for _ in range(3))
    shape = (bsz, heads, seq, hd)

    with flop_counter() as counter:
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
    per_op = counter.get_flop_counts()["Global"]
    # Dropout 0 on CPU takes the fused kernel, the op stock FlopCounterMode has no formula for.
    assert set(per_op) == {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu}
    forward = counter.get_total_flops()
    # QK^T and PV, 2·T·T·D each per (batch, head); causality is not discounted (as in torch's formula).
    assert forward == 4 * bsz * heads * seq * seq * hd
    assert forward == torch_flop_counter.sdpa_flop_count(shape, shape, shape)

    total = count_flops(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward())
    backward = total - forward
    assert backward > 0
    assert backward == torch_flop_counter.sdpa_backward_flop_count(shape, shape, shape, shape)
    # Recompute QK^T, then dV, dP, dQ, dK: five T·T·D matmuls.
    assert backward == 10 * bsz * heads * seq * seq * hd


def test_registration_is_idempotent() -> None:
    before = dict(torch_flop_counter.flop_registry)
    importlib.reload(trainer.measure.time.flops)
    assert torch_flop_counter.flop_registry == before
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward in before


def test_the_moe_grouped_matmul_counts_its_flops() -> None:
    """An MoE layer's experts (12 routed tokens over 3 experts, K=8 → N=8): forward 2·M·K·N, and the weight
    gradient's 2-D × 2-D form, where the groups split the contraction, the same."""
    from trainer.measure.time.flops import count_flops

    a, b = torch.randn(12, 8), torch.randn(3, 8, 8)
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)
    assert count_flops(lambda: torch._grouped_mm(a, b, offs=offs)) == 2 * 12 * 8 * 8
    grad_out = torch.randn(12, 8)
    assert count_flops(lambda: torch._grouped_mm(a.t(), grad_out, offs=offs)) == 2 * 8 * 12 * 8
