"""A LLaMA-style decoder in the nanoGPT mould: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention.

Plain PyTorch, like models/gpt.py, and the same contract (models/adapter.py): `layers` (each called as
`layer(x, cos, sin)`: the rotary table is the context a layer needs besides the residual stream),
`hidden_states(idx)`, `lm_head`, and the attention seam `LlamaAttention.core_attention` (the GQA key/value repeat,
QKᵀ, causal softmax, dropout, ·V), which `selective` recomputes.

Parameter names follow Hugging Face's `LlamaForCausalLM` (`model.layers.0.self_attn.q_proj.weight`, ...), so a
state_dict converts by prefix and the tests hold the numerics to the HF reference.
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
class LlamaConfig:
    vocab_size: int = 256  # set from the tokenizer at build time
    block_size: int = 256  # longest context the rotary table covers
    n_layer: int = 6
    n_head: int = 8
    # Grouped-query attention: n_head query heads share n_kv_head key/value heads (LLaMA-3: 32 / 8). None: n_head.
    n_kv_head: int | None = None
    n_embd: int = 256
    # SwiGLU hidden size. None: LLaMA's rule, 2/3 of 4·n_embd rounded up to a multiple of 256 (11008 at 4096).
    mlp_hidden: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # LLaMA-2: 1e4; LLaMA-3: 5e5
    # LLaMA trains without dropout; on, it drops attention probabilities and both residual branches, and
    # recompute must replay the same masks.
    dropout: float = 0.0
    tie_embeddings: bool = False  # LLaMA-3.2-1B ties lm_head to the embedding; 7B/8B do not
    # "sdpa": fused scaled_dot_product_attention (GQA inside the kernel, no T×T scores kept); "eager": explicit
    # softmax(QKᵀ)V that stores them, the path `selective` recomputes.
    attention: str = "sdpa"
    # "half": HF's rotation of each head's two halves, in the residual stream's dtype. "complex": torchtitan's up to
    # its 0.2 releases, channel pairs as fp32 complex numbers times a complex64 table (its published H100 rows ran
    # it): fp32 copies of q and k each layer.
    rope: str = "half"
    # False: SDPA shares each key/value head among its query heads (enable_gqa). True: keys and values copied to
    # every query head before attention, as torchtitan's model did up to 0.2 (the kernel then keeps the copies).
    repeat_kv: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)} must be ≥ 1")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            raise ValueError(
                f"model.n_head={self.n_head} is not divisible by model.n_kv_head={self.n_kv_head}; "
                "pick n_kv_head as a divisor of n_head"
            )
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"model.n_embd={self.n_embd} / model.n_head={self.n_head} must be an even whole head size "
                "(rotary positions rotate pairs of channels)"
            )
        if self.mlp_hidden is None:
            self.mlp_hidden = 256 * math.ceil(int(2 * 4 * self.n_embd / 3) / 256)
        if self.mlp_hidden < 1:
            raise ValueError(f"model.mlp_hidden={self.mlp_hidden} must be ≥ 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.attention not in ("sdpa", "eager"):
            raise ValueError(f"model.attention={self.attention!r} must be 'sdpa' or 'eager'")
        if self.rope not in ("half", "complex"):
            raise ValueError(f"model.rope={self.rope!r} must be 'half' or 'complex'")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def rotary_table(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position × frequency, (block_size, head_dim), in HF's half-rotation layout."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    t = torch.arange(config.block_size, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)  # (block_size, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (block_size, d)
    return emb.cos(), emb.sin()


def complex_rotary_table(config: LlamaConfig) -> torch.Tensor:
    """torchtitan's `precompute_freqs_cis`: e^(i·position·frequency), (block_size, head_dim / 2), complex64."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2)[: d // 2].float() / d))
    freqs = torch.outer(torch.arange(config.block_size).float(), inv_freq)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_complex_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """torchtitan's `apply_rotary_emb` for one of q, k: x (B, T, heads, head_dim), its channel pairs as fp32 complex
    numbers, times freqs_cis (T, head_dim / 2), back to x's dtype."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis.view(1, x.shape[1], 1, xc.shape[-1])).flatten(3)
    return out.type_as(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, head_dim) rotated by position; cos/sin (T, head_dim) broadcast over batch and heads."""
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    """LLaMA's norm: x / rms(x) · weight, computed in fp32 whatever the input dtype (as the HF reference does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        assert config.n_kv_head is not None
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.attention, self.rope, self.repeat_kv = config.attention, config.rope, config.repeat_kv
        self.q_proj = nn.Linear(config.n_embd, config.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_head * self.head_dim, config.n_embd, bias=False)
        self.attn_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor | None) -> torch.Tensor:
        """`cos`, `sin`: the rotary table's (T, head_dim) halves; under rope=complex `cos` is the complex table
        (T, head_dim / 2) and `sin` None."""
        B, T, _ = x.shape
        # (B, T, heads·head_dim) -> (B, heads, T, head_dim)
        # Head counts as -1: under tensor parallelism each rank holds its share of the heads (n_head / t).
        q = self.q_proj(x).view(B, T, -1, self.head_dim)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        if sin is None:  # rope=complex: rotated before the heads move forward, as torchtitan rotates
            q, k = apply_complex_rotary(q, cos), apply_complex_rotary(k, cos)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if sin is not None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.repeat_kv and k.shape[1] != q.shape[1]:  # torchtitan's repeat_kv: every query head its own copy
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        y = self.core_attention(q, k, v)
        # (B, n_head, T, head_dim) -> (B, T, n_head·head_dim)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.o_proj(y)

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """GQA repeat → QKᵀ → causal softmax → dropout → ·V: the unit `selective` recomputes."""
        p = self.attn_dropout.p if self.training else 0.0  # one probability for both paths
        if self.attention == "sdpa":  # the fused kernel shares each key/value head itself
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=True)
        groups = q.shape[1] // k.shape[1]  # 1 where repeat_kv already copied them
        k = k.repeat_interleave(groups, dim=1)  # (B, n_kv_head, T, hd) -> (B, n_head, T, hd)
        v = v.repeat_interleave(groups, dim=1)
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, n_head, T, T)
        # Made per call rather than kept as a (block_size, block_size) buffer per layer: at LLaMA-3's 8K context
        # 32 such buffers would hold 2 GiB. masked_fill keeps it for backward either way.
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        att = att.masked_fill(future, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        return att @ v


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        assert config.mlp_hidden is not None
        self.gate_proj = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = LlamaMLP(config)
        self.resid_dropout = nn.Dropout(config.dropout)

    @property
    def attn(self) -> LlamaAttention:
        return self.self_attn

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor | None) -> torch.Tensor:
        x = x + self.resid_dropout(self.self_attn(self.input_layernorm(x), cos, sin))
        x = x + self.resid_dropout(self.mlp(self.post_attention_layernorm(x)))
        return x


class LlamaDecoder(nn.Module):
    """Embedding, layers and final norm: HF's `LlamaModel`, so parameter names match under `model.`."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList([LlamaBlock(config) for _ in range(config.n_layer)])
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        cos, sin = rotary_table(config)
        # Buffers, not parameters, and non-persistent: state_dict keys are the weights alone.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.rope = config.rope
        if config.rope == "complex":
            self.register_buffer("freqs_cis", complex_rotary_table(config), persistent=False)


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaDecoder(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # HF's LlamaPreTrainedModel: normal(0, 0.02) for every matmul and the embedding; norms start at 1.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    # What a pipeline stage keeps besides its layers (trainer/parallel/pipeline.py); every stage keeps the rotary
    # tables (buffers).
    pipeline_parts: ClassVar[dict[str, tuple[str, ...]]] = {
        "first": ("model.embed_tokens",),
        "last": ("model.norm", "lm_head"),
    }

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def tensor_parallel_plan(self, sequence_parallel: bool) -> dict[str, Any]:
        """Megatron's split as torchtitan writes it for its LLaMA (models/tensor_parallel.py: megatron_plan): q/k/v
        and gate/up by output column, o and down by input row; the attention's rotary tables (its two other inputs)
        whole on every rank."""
        from models.tensor_parallel import megatron_plan

        return megatron_plan(
            sequence_parallel,
            embedding="model.embed_tokens",
            head="lm_head",
            final_norm="model.norm",
            layers="model.layers",
            norms=("input_layernorm", "post_attention_layernorm"),
            blocks={"self_attn": 2, "mlp": 0},
            colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
            rowwise=("self_attn.o_proj", "mlp.down_proj"),
        )

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids → (B, T, C) final-norm hidden states, the input of the output projection."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds model.block_size={self.config.block_size}")
        # a later pipeline stage (trainer/parallel/pipeline.py) has no embedding: its input is the residual stream
        x = idx if self.model.embed_tokens is None else self.model.embed_tokens(idx)  # (B, T, C)
        # The rotary table in the residual stream's dtype (bf16 weights: bf16), as HF casts it.
        cos: torch.Tensor = self.model.rope_cos[:T].to(x.dtype)
        sin: torch.Tensor | None = self.model.rope_sin[:T].to(x.dtype)
        if self.model.rope == "complex":  # the complex64 table as it is, as torchtitan passes freqs_cis
            cos, sin = self.model.freqs_cis[:T], None
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x if self.model.norm is None else self.model.norm(x)

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


register_native(
    "llama",
    Llama,
    LlamaConfig,
    preset="llama-tiny",
    tiny={"n_layer": 2, "n_embd": 64, "n_head": 4, "n_kv_head": 2, "mlp_hidden": 128, "dropout": 0.1},
)
