"""A GPT-2-style decoder in the nanoGPT mould.

Plain PyTorch: no Lightning, no policies, no logging, so a bare training loop, the benchmark and the
estimator can all use it. It meets the decoder contract of models/adapter.py: `layers` (called as
`layer(x)`), `hidden_states(idx)` (embeddings → layers → final norm), `lm_head`, and the attention seam
`CausalSelfAttention.core_attention` (the QKᵀ → softmax → dropout → ·V core that `selective` recomputes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.native import register_native


@dataclass
class GPTConfig:
    vocab_size: int = 256  # set from the tokenizer at build time; 256 = UTF-8 bytes
    block_size: int = 256  # longest context the position table covers
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.1  # on: recompute must replay the same masks, which is what the tests check
    bias: bool = True  # GPT-2 has biases; they cost activation bytes the estimator must count
    tie_embeddings: bool = True  # GPT-2 ties lm_head to the token embedding (saves vocab×d parameters)
    # "sdpa": fused F.scaled_dot_product_attention, which never keeps the T×T scores (it recomputes them in its
    # backward); "eager": explicit softmax(QKᵀ)V that stores them, the path selective recompute is for.
    attention: str = "eager"

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}; "
                "pick n_embd as a multiple of n_head"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.attention not in ("sdpa", "eager"):
            raise ValueError(f"model.attention={self.attention!r} must be 'sdpa' or 'eager'")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)} must be ≥ 1")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.attention = config.attention
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        # A buffer, not a parameter, and non-persistent so state_dict stays the same for both attention paths.
        mask = torch.ones(config.block_size, config.block_size, dtype=torch.bool).tril()
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Thirds and head counts as -1: under tensor parallelism each rank's c_attn gives its share of the heads
        # of each of q, k and v, side by side (n_head / t of them).
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        y = self.core_attention(q, k, v)
        # (B, n_head, T, head_dim) -> (B, T, C)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.c_proj(y)

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """QKᵀ → causal softmax → dropout → ·V. The unit Korthikanti et al. (2022) recompute selectively."""
        if self.attention == "sdpa":
            p = self.attn_dropout.p if self.training else 0.0  # one probability for both paths
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, nh, T, T)
        att = att.masked_fill(~self.causal_mask[:T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        return att @ v


class GPTMLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class GPTBlock(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = GPTMLP(config)
        # nanoGPT's attention ends in this dropout; here the block applies it, so the attention module's one dropout
        # is its core's: under tensor parallelism without sequence parallelism a rank runs the attention on its own
        # heads (its dropout draws per rank) and this one on the whole output (drawn alike on every rank).
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_dropout(self.attn(self.ln_1(x)))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([GPTBlock(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/√(2L) so the residual stream's variance stays put with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    # What a pipeline stage keeps besides its layers (trainer/parallel/pipeline.py): the first the embeddings, the
    # last the final norm and the head.
    pipeline_parts: ClassVar[dict[str, tuple[str, ...]]] = {
        "first": ("transformer.wte", "transformer.wpe", "transformer.drop"),
        "last": ("transformer.ln_f", "lm_head"),
    }

    @property
    def layers(self) -> nn.ModuleList:
        return self.transformer.h

    def tensor_parallel_plan(self, sequence_parallel: bool) -> dict[str, Any]:
        """Megatron's split of GPT (models/tensor_parallel.py: megatron_plan): the fused query/key/value (each of q,
        k and v split alike) and the MLP's first projection by output column, both output projections by input
        row; the position table added to the token embedding's output, each rank adding the rows of its own
        stretch of the sequence under sequence parallelism."""
        from models.tensor_parallel import megatron_plan

        return megatron_plan(
            sequence_parallel,
            embedding="transformer.wte",
            head="lm_head",
            final_norm="transformer.ln_f",
            layers="transformer.h",
            norms=("ln_1", "ln_2"),
            blocks={"attn": 0, "mlp": 0},
            colwise=("mlp.c_fc",),
            fused={"attn.c_attn": 3},
            rowwise=("attn.c_proj", "mlp.c_proj"),
            positions="transformer.wpe",
        )

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        wpe = self.transformer.wpe  # None on a later pipeline stage
        return n - wpe.weight.numel() if exclude_embeddings and wpe is not None else n

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids → (B, T, C) final-norm hidden states, the input of the output projection."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds model.block_size={self.config.block_size}")
        if self.transformer.wte is None:  # a later pipeline stage (trainer/parallel/pipeline.py): x is the stream
            x = idx
        else:
            pos = torch.arange(T, device=idx.device)
            x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for layer in self.layers:
            x = layer(x)
        return x if self.transformer.ln_f is None else self.transformer.ln_f(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, hidden_only: bool = False) -> Any:
        """(logits, loss) — or, with `hidden_only`, the final hidden states alone, for a loss head of its own (a
        module call, so hooks on the model, FSDP2's among them, run around it)."""
        if hidden_only:
            return self.hidden_states(idx)
        logits = self.lm_head(self.hidden_states(idx))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
        return logits, loss


register_native("gpt", GPT, GPTConfig, preset="micro", tiny={})  # micro is already test-sized
