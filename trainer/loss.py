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

Every option computes the model's own objective: the logits go through the family's transform
(`adapter.logit_transform`: Cohere's logit scale, Gemma-2's final soft-capping) before the cross-entropy, as the
model's forward does before its own loss. `fused` takes a pure scale on its input (s·(hW) = (s·h)W); a soft-cap
cannot enter torch's fused op, so `fused` refuses such a model in one line.

`chunk_tokens` null (the default) splits the micro-batch's tokens into DEFAULT_CHUNKS chunks, so a chunked head is
chunked at any shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.adapter import LogitTransform

LOSSES = ("standard", "chunked", "fused")
DEFAULT_CHUNKS = 8  # chunk_tokens null: the micro-batch's tokens in this many chunks (torchtune's num_output_chunks)


@dataclass
class LossConfig:
    name: str = "standard"  # standard | chunked | fused
    chunk_tokens: int | None = None  # chunked / fused: tokens whose logits are alive at once (null: N / 8)
    ignore_index: int = -100  # targets with this value add nothing to the loss or the gradients

    def __post_init__(self) -> None:
        if self.name not in LOSSES:
            raise ValueError(f"loss={self.name!r} is unknown; choose one of: {', '.join(LOSSES)}")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ValueError(f"loss.chunk_tokens={self.chunk_tokens} must be ≥ 1 (tokens per chunk of the head)")
        if self.name == "fused" and not hasattr(F, "linear_cross_entropy"):
            raise ValueError(
                "loss=fused needs torch.nn.functional.linear_cross_entropy (torch ≥ 2.13; this is "
                f"{torch.__version__}); use loss=chunked"
            )

    def chunk_for(self, n_tokens: int) -> int:
        """Tokens per chunk for a micro-batch of `n_tokens`: the configured count, or N / DEFAULT_CHUNKS."""
        return self.chunk_tokens if self.chunk_tokens is not None else max(1, math.ceil(n_tokens / DEFAULT_CHUNKS))

    def check_transform(self, transform: LogitTransform) -> None:
        """Refuse (ValueError, one line) a model's logit transform this head cannot apply."""
        if self.name == "fused" and transform.scale is None:
            raise ValueError(
                f"loss=fused cannot apply {transform.source}'s logit transform ({transform.describe()}) inside "
                "torch's fused op; use loss=chunked (as frugal, and exact) or loss=standard"
            )


def head_loss(
    hidden: torch.Tensor,
    head: nn.Linear,
    targets: torch.Tensor,
    cfg: LossConfig,
    transform: LogitTransform | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of `transform(head(hidden))` against `targets` (ignored tokens left out), as an fp32
    scalar: the model's own loss. hidden (B, T, C), targets (B, T); the head's weight (V, C) and bias (V) or None.
    """
    transform = transform or LogitTransform()
    h = hidden.reshape(-1, hidden.size(-1))  # (N, C)
    t = targets.reshape(-1)  # (N,)
    if cfg.name == "standard":
        return F.cross_entropy(transform(head(h)).float(), t, ignore_index=cfg.ignore_index)
    chunk_tokens = cfg.chunk_for(h.size(0))
    if cfg.name == "chunked":
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        for start in range(0, h.size(0), chunk_tokens):
            chunk = slice(start, start + chunk_tokens)
            total = total + _checkpointed_chunk(h[chunk], t[chunk], head, transform, cfg.ignore_index)
        return total / (t != cfg.ignore_index).sum()
    return _fused(h, head, t, cfg, chunk_tokens, transform)


def _chunk_loss_sum(
    h: torch.Tensor, t: torch.Tensor, head: nn.Linear, transform: LogitTransform, ignore_index: int
) -> torch.Tensor:
    return F.cross_entropy(transform(head(h)).float(), t, ignore_index=ignore_index, reduction="sum")


def _checkpointed_chunk(
    h: torch.Tensor, t: torch.Tensor, head: nn.Linear, transform: LogitTransform, ignore_index: int
) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return _chunk_loss_sum(h, t, head, transform, ignore_index)
    return checkpoint(
        _chunk_loss_sum, h, t, head, transform, ignore_index, use_reentrant=False, preserve_rng_state=False
    )


def _fused(
    h: torch.Tensor, head: nn.Linear, t: torch.Tensor, cfg: LossConfig, chunk_tokens: int, transform: LogitTransform
) -> torch.Tensor:
    cfg.check_transform(transform)
    scale = transform.scale
    if scale is not None and scale != 1.0:  # s·(hWᵀ + b) = (s·h)Wᵀ + s·b
        h = h * scale
    w, b = head.weight, head.bias
    if b is not None and scale is not None and scale != 1.0:
        b = b * scale
    # The op is not on autocast's lists: cast as autocast casts lm_head's matmul, so every option computes the
    # logits in the same dtype.
    if torch.is_autocast_enabled(h.device.type):
        dtype = torch.get_autocast_dtype(h.device.type)
        h, w = h.to(dtype), w.to(dtype)
        b = None if b is None else b.to(dtype)
    options = nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_tokens, chunking_method=None)
    loss = F.linear_cross_entropy(h, w, t, linear_bias=b, ignore_index=cfg.ignore_index, options=options)
    return loss.float()
