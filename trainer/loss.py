"""The head and the loss as a treatment: how the final hidden states become the training loss (conf/loss/).

At a large vocabulary the logits and their fp32 upcast are the largest activation of a step (LLaMA-3: V = 128,256;
at 8 × 4096 tokens the fp32 logits alone are 16.8 GB), and no checkpointing policy touches them. Three ways:

  standard  lm_head → (N, V) logits → fp32 → cross-entropy. The logits, their fp32 copy and the log-softmax
            (kept for backward) are alive together.
  chunked   the tokens in chunks of `chunk_tokens`: each chunk's logits and loss are computed under a checkpoint and
            summed, so only the chunk's hidden states are kept and its logits are recomputed in backward; no N×V
            tensor is ever alive, one chunk's is (litgpt's chunked_cross_entropy, torchtune's chunked output loss).
  fused     torch's own `torch.nn.functional.linear_cross_entropy` (torch ≥ 2.13) with
            `LinearCrossEntropyOptions(batch_chunk_size=chunk_tokens)`: the projection and the loss in one op,
            chunked over tokens, gradients made in its forward. It is one custom op to the dispatcher, so the
            live-tensor tracker (and the estimator) see its outputs and kept gradients but not the per-chunk
            workspace inside it (about chunk_tokens × V × 4 bytes); on CUDA the allocator's peak includes it.

Every option averages over the tokens whose target is not `ignore_index` (-100, as torch's cross-entropy), so the
three agree: `chunked` sums the same per-token losses in another order (≤ 1e-6 relative in fp32; tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

LOSSES = ("standard", "chunked", "fused")


@dataclass
class LossConfig:
    name: str = "standard"  # standard | chunked | fused
    chunk_tokens: int = 1024  # chunked / fused: tokens whose logits are alive at once
    ignore_index: int = -100  # targets with this value add nothing to the loss or the gradients

    def __post_init__(self) -> None:
        if self.name not in LOSSES:
            raise ValueError(f"loss={self.name!r} is unknown; choose one of: {', '.join(LOSSES)}")
        if self.chunk_tokens < 1:
            raise ValueError(f"loss.chunk_tokens={self.chunk_tokens} must be ≥ 1 (tokens per chunk of the head)")
        if self.name == "fused" and not hasattr(F, "linear_cross_entropy"):
            raise ValueError(
                "loss=fused needs torch.nn.functional.linear_cross_entropy (torch ≥ 2.13; this is "
                f"{torch.__version__}); use loss=chunked"
            )


def head_loss(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Mean cross-entropy of `head(hidden)` against `targets` (ignored tokens left out), as an fp32 scalar.

    hidden (B, T, C), targets (B, T); the head's weight (V, C) and bias (V) or None.
    """
    h = hidden.reshape(-1, hidden.size(-1))  # (N, C)
    t = targets.reshape(-1)  # (N,)
    if cfg.name == "standard":
        return F.cross_entropy(head(h).float(), t, ignore_index=cfg.ignore_index)
    if cfg.name == "chunked":
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        for start in range(0, h.size(0), cfg.chunk_tokens):
            chunk = slice(start, start + cfg.chunk_tokens)
            total = total + _checkpointed_chunk(h[chunk], t[chunk], head, cfg.ignore_index)
        return total / (t != cfg.ignore_index).sum()
    return _fused(h, head, t, cfg)


def _chunk_loss_sum(h: torch.Tensor, t: torch.Tensor, head: nn.Linear, ignore_index: int) -> torch.Tensor:
    return F.cross_entropy(head(h).float(), t, ignore_index=ignore_index, reduction="sum")


def _checkpointed_chunk(h: torch.Tensor, t: torch.Tensor, head: nn.Linear, ignore_index: int) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return _chunk_loss_sum(h, t, head, ignore_index)
    return checkpoint(_chunk_loss_sum, h, t, head, ignore_index, use_reentrant=False, preserve_rng_state=False)


def _fused(h: torch.Tensor, head: nn.Linear, t: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    w, b = head.weight, head.bias
    # The op is not on autocast's lists: cast as autocast casts lm_head's matmul, so every option computes the
    # logits in the same dtype.
    if torch.is_autocast_enabled(h.device.type):
        dtype = torch.get_autocast_dtype(h.device.type)
        h, w = h.to(dtype), w.to(dtype)
        b = None if b is None else b.to(dtype)
    options = nn.LinearCrossEntropyOptions(batch_chunk_size=cfg.chunk_tokens, chunking_method=None)
    loss = F.linear_cross_entropy(h, w, t, linear_bias=b, ignore_index=cfg.ignore_index, options=options)
    return loss.float()
