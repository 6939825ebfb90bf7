"""Memory and FLOP estimator: does a configuration fit, and what does each policy cost? No data, no GPU.

    python -m trainer.estimate model=gpt2-medium seq_len=1024 batch_size=8 policy=full --budget 40GB
    python -m trainer.estimate policy=selective --device cuda --json estimate.json
    python -m trainer.estimate policy=full --autocast-cache    # a bare loop's default autocast (weight cache on)

The same Hydra overrides as train.py compose the same config; the answer is a breakdown of memory by component for
the configured policy, the forward/backward/recompute FLOPs, and a table over every registered policy. The figures
are the two train.py logs: memory/activation_peak_mib (`activation_bytes`) and memory/peak_total_mib (`peak_bytes`).

How activation memory is modelled
---------------------------------
In the spirit of Korthikanti et al. 2022 (Table 2), but per tensor and per dtype, with the effects measured on this
project's model (../shared/BACKGROUND.md): fp32 residual stream under autocast, dropout keeping a noise tensor in the
input dtype on CPU (a 1-byte bool mask on CUDA), biases, GELU input, eager vs fused attention, the CPU math fallback of
SDPA with dropout (fp32 T×T tensors), and the bf16 weight copies autocast makes. train.py runs autocast as Lightning's
precision plugin does, with its weight cache off (`cache_enabled=False`): a weight's cast lives as long as autograd
keeps it (to its backward when stored; not past its op under checkpoint). `Shapes.autocast_cache` (--autocast-cache)
models the default cache instead, which holds every cast to the end of the forward (and of each recompute), as a
bare loop under a plain ``torch.autocast`` sees it.

1. ``block_forward`` lists, op by op, every tensor one transformer block creates in forward (name, shape, dtype,
   producing aten op, whether autograd saves it) and when forward is done with it. ``block_backward`` lists what its
   backward allocates (the gradients in flight) and what each backward node releases. The same for the embedding
   and the head (ln_f, lm_head, cross-entropy).
2. A treatment decides what survives from forward to backward: ``none`` keeps what autograd saves; ``full`` keeps
   only the checkpointed segment's input and recomputes the rest when its backward starts (with non-reentrant
   checkpoint's early stop: ops after the last saved tensor are not rerun); ``selective`` recomputes the core
   attention only; ``op_sac`` keeps the outputs of the listed ops (the SAC cache) and recomputes the rest;
   ``offload`` moves saved tensors ≥ min_bytes to the host on CUDA (block i and the prefetched block i-1 come back
   in backward) and is a no-op on CPU. ``block_inventory`` shows the result per block.
3. ``simulate`` replays one micro-batch in Lightning's order (forward with last step's gradients alive, zero_grad,
   then backward: the head, the Plan's segments in reverse with the recomputes where torch triggers them, the
   embedding, each parameter's .grad appearing where its gradient is made) on a live-bytes timeline, with two peaks.
   The activation peak leaves the parameters' gradients out: it is what the live-tensor tracker measures as
   ``peak_bytes_excluding(param grads)`` (activations, the recompute transient, gradients in flight, logits/loss,
   autocast weight copies, and the tied embedding/lm_head weight's first gradient contribution, which autograd
   buffers until the embedding's backward adds the second). The step peak counts them.
4. ``estimate_policy`` adds what the step holds throughout (parameters, buffers, AdamW state) to the larger of the
   replay's step peak and the optimizer step (every gradient and AdamW.step()'s temporaries): train.py's
   memory/peak_total_mib, the tracker over the whole step with the training state adopted. With accumulation, a
   second replay covers the later micro-batches, which run with every gradient alive.

The tests hold this model to the tracker within 10 % for every registered policy on CPU (the agreement observed is
within a few hundred bytes), and to real ``trainer.run.train`` runs' summaries; on CUDA (bool dropout masks, fp32
softmax under autocast, fused kernels with dropout, allocator rounding) it follows the same rules but has not been
measured here.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import OmegaConf

from trainer.policies import POLICIES, Plan, Policy, PolicyError, build_policy
from trainer.schema import Config, ConfigError

MIB = 2**20
ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "bool": 1, "int64": 8}
# The default SAC save list names these kernels; which one runs depends on the device and dtype.
CPU_FUSED_SDPA = "_scaled_dot_product_flash_attention_for_cpu"
CUDA_FLASH_SDPA = "_scaled_dot_product_flash_attention"
CUDA_EFFICIENT_SDPA = "_scaled_dot_product_efficient_attention"


# ----------------------------------------------------------------------------------------------------
# Shapes: everything the memory model needs to know about a configuration.
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shapes:
    """One micro-batch of the GPT: sizes, precision and device, and the dtype rules derived from them."""

    batch: int  # B, sequences per micro-batch
    seq: int  # T, tokens per sequence
    n_embd: int  # C
    n_head: int  # a
    n_layer: int  # L
    vocab: int  # V
    block_size: int  # rows of the position table (parameters only)
    dropout: float = 0.0
    bias: bool = True
    attention: str = "eager"  # eager | sdpa
    precision: str = "bf16-mixed"  # bf16-mixed | bf16-true | 32-true | 16-mixed
    device: str = "cpu"  # cpu | cuda: dropout masks, softmax under autocast and SDPA kernels differ
    # Lightning's precision plugin runs autocast with its weight cache off (cache_enabled=False): a parameter's cast
    # lives only as long as autograd keeps it. True models a bare loop's default autocast, whose cache holds every
    # cast to the end of the forward (and of each recompute).
    autocast_cache: bool = False

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} must be 'cpu' or 'cuda'")
        if self.precision not in ("bf16-mixed", "bf16-true", "32-true", "16-mixed"):
            raise ValueError(f"precision={self.precision!r} is not one the trainer knows")
        if self.attention not in ("eager", "sdpa"):
            raise ValueError(f"attention={self.attention!r} must be 'eager' or 'sdpa'")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")

    @property
    def tokens(self) -> int:  # N = B·T
        return self.batch * self.seq

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def autocast(self) -> bool:
        return self.precision.endswith("-mixed")

    @property
    def compute(self) -> str:
        """dtype matmuls run in (and their outputs have)."""
        return {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "32-true": "fp32"}[self.precision]

    @property
    def param(self) -> str:
        """dtype of parameters, of their gradients and of the residual stream (embeddings are never autocast)."""
        return "bf16" if self.precision == "bf16-true" else "fp32"

    @property
    def ln_stat(self) -> str:
        """LayerNorm mean/rstd: the input dtype on CPU, fp32 on CUDA."""
        return "fp32" if self.device == "cuda" else self.param

    @property
    def attn_kernel(self) -> str:
        """eager | fused | math. On CPU, SDPA with dropout falls back to the math path (fp32 T×T, kept)."""
        if self.attention == "eager":
            return "eager"
        if self.device == "cpu" and self.dropout > 0:
            return "math"
        return "fused"

    @property
    def merge_copies(self) -> bool:
        """matmul reshapes (B, a, T, d) head views to (B·a, T, d): a copy unless B or a is 1, where it is a view."""
        return self.batch > 1 and self.n_head > 1

    @property
    def sdpa_op(self) -> str:
        if self.device == "cpu":
            return CPU_FUSED_SDPA
        return CUDA_EFFICIENT_SDPA if self.compute == "fp32" else CUDA_FLASH_SDPA

    def mask_dtype(self, input_dtype: str) -> str:
        """What dropout keeps for backward: a scaled noise tensor in the input dtype on CPU, a bool mask on CUDA."""
        return "bool" if self.device == "cuda" else input_dtype

    @property
    def softmax_dtype(self) -> str:
        """CUDA autocast runs softmax in fp32 (its fp32 op list); CPU autocast leaves it in bf16."""
        return "fp32" if self.autocast and self.device == "cuda" else self.compute


# ----------------------------------------------------------------------------------------------------
# Tensors and programs: what each op allocates, what autograd saves, when forward lets go of it.
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    name: str  # unique in the replay, e.g. "b3.softmax" (block 3), "head.logits", "g4" (a residual gradient)
    shape: tuple[int, ...]
    dtype: str
    op: str  # aten op that produces it (what SAC's save list matches)
    saved: bool = False  # autograd keeps it for backward (under `none`)
    cached: bool = False  # an autocast cast of a parameter: the autocast cache, when on, holds it until autocast exits
    grad: bool = False  # a parameter's gradient (its .grad, or what is summed into it): not activation memory
    region: str = ""  # "core" for the core attention (what `selective` recomputes)
    flops: int = 0  # FLOPs of the op that produces it (matmuls only, as FlopCounterMode counts)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Step:
    """One op: allocate `alloc`, then release `release` (names). Backward steps may carry FLOPs of their own."""

    alloc: tuple[Tensor, ...] = ()
    release: tuple[str, ...] = ()
    flops: int = 0  # backward matmul FLOPs
    recompute_point: bool = False  # backward: the first unpack of a saved tensor; a pending recompute runs here
    region: str = ""  # "core": part of the core attention (what `selective` recomputes)


class _Builder:
    """Names tensors under a prefix ("@name" is absolute) and collects steps, so programs read like the model."""

    def __init__(self, sh: Shapes, prefix: str) -> None:
        self.sh = sh
        self.prefix = prefix
        self.steps: list[Step] = []
        self.region = ""

    def n(self, name: str) -> str:
        return name[1:] if name.startswith("@") else self.prefix + name

    def t(self, name: str, shape: tuple[int, ...], dtype: str, op: str, **kw: Any) -> Tensor:
        kw.setdefault("region", self.region)
        return Tensor(self.n(name), shape, dtype, op, **kw)

    def op(self, *alloc: Tensor, release: Iterable[str] = ()) -> None:
        """A forward op: allocate its outputs, then let go of what forward no longer needs."""
        region = alloc[0].region if alloc else self.region
        self.steps.append(Step(alloc, tuple(self.n(r) for r in release if r), region=region))

    def bwd(self, *alloc: Tensor, release: Iterable[str] = (), flops: int = 0) -> None:
        """A backward node: allocate its gradients, then release its saved tensors and consumed gradients."""
        self.steps.append(Step(alloc, tuple(self.n(r) for r in release if r), flops))

    def recompute_point(self) -> None:
        self.steps.append(Step(recompute_point=True))


# -- forward pieces ------------------------------------------------------------------------------------


def _layernorm(b: _Builder, name: str, shape: tuple[int, ...], out_saved: bool) -> None:
    """nn.LayerNorm: output in the input dtype (fp32 residual stream under autocast); saves input, mean, rstd."""
    sh = b.sh
    stat = shape[:-1] + (1,)
    b.op(
        b.t(name, shape, sh.param, "native_layer_norm", saved=out_saved),
        b.t(f"{name}.mean", stat, sh.ln_stat, "native_layer_norm", saved=True),
        b.t(f"{name}.rstd", stat, sh.ln_stat, "native_layer_norm", saved=True),
        release=[f"{name}.mean", f"{name}.rstd"],  # nobody but autograd holds them
    )


def _linear(b: _Builder, name: str, x_dtype: str, fin: int, out: Tensor, bias: bool = True) -> None:
    """F.linear. Under autocast its arguments are cast in order to the compute dtype: an fp32 input (saved), the
    weight (saved) and the bias (not saved: gone when the op returns, unless the autocast cache holds it). Without
    autocast it saves the input itself."""
    sh = b.sh
    p = sh.compute
    fout = out.shape[-1]
    release = []
    if sh.autocast:
        if x_dtype != p:
            b.op(b.t(f"{name}.in16", out.shape[:-1] + (fin,), p, "_to_copy", saved=True))
            release.append(f"{name}.in16")
        b.op(b.t(f"{name}.w16", (fout, fin), p, "_to_copy", saved=True, cached=True))
        release.append(f"{name}.w16")
        if sh.bias and bias:
            b.op(b.t(f"{name}.b16", (fout,), p, "_to_copy", cached=True))
            release.append(f"{name}.b16")
    b.op(out, release=release)


def _dropout(
    b: _Builder, name: str, shape: tuple[int, ...], dtype: str, release: Sequence[str], out: str = "", out_saved=False
) -> str:
    """nn.Dropout in training; returns its output's name ("" for p=0, where no op runs)."""
    sh = b.sh
    if sh.dropout <= 0:
        return ""
    out = out or f"{name}.out"
    if sh.device == "cuda":  # native_dropout: output and a bool mask from one kernel
        b.op(
            b.t(out, shape, dtype, "native_dropout", saved=out_saved),
            b.t(f"{name}.mask", shape, "bool", "native_dropout", saved=True),
            release=[*release, f"{name}.mask"],
        )
    else:  # CPU: input * bernoulli_(empty_like(input)).div_(1 - p): the scaled noise is saved in the input dtype
        b.op(b.t(f"{name}.mask", shape, sh.mask_dtype(dtype), "empty_like", saved=True))
        b.op(b.t(out, shape, dtype, "mul", saved=out_saved), release=[*release, f"{name}.mask"])
    return out


def _core_eager(b: _Builder, out: str) -> None:
    """(q @ kᵀ)·scale → masked_fill → softmax → dropout → @ v, as CausalSelfAttention.core_attention does it."""
    sh = b.sh
    B, T, a, hd, p = sh.batch, sh.seq, sh.n_head, sh.head_dim, sh.compute
    smt = sh.softmax_dtype
    mm = 2 * B * a * T * T * hd
    copies = sh.merge_copies
    if copies:
        b.op(b.t("q", (B, a, T, hd), p, "clone", saved=True), b.t("k", (B, a, hd, T), p, "clone", saved=True))
    b.op(b.t("scores", (B, a, T, T), p, "bmm", flops=mm), release=["q", "k"])
    b.op(b.t("scaled", (B, a, T, T), p, "mul"), release=["scores"])
    b.op(b.t("causal", (T, T), "bool", "bitwise_not", saved=True))
    b.op(b.t("masked", (B, a, T, T), p, "masked_fill"), release=["scaled", "causal"])
    sm_in = "masked"
    if smt != p:  # CUDA autocast: softmax is on the fp32 list
        b.op(b.t("masked32", (B, a, T, T), smt, "_to_copy"), release=["masked"])
        sm_in = "masked32"
    b.op(b.t("softmax", (B, a, T, T), smt, "_softmax", saved=True), release=[sm_in])
    att = _dropout(b, "attn_drop", (B, a, T, T), smt, release=["softmax"], out_saved=smt == p) or "softmax"
    if smt != p:  # the matmul casts the fp32 probabilities back to the compute dtype and saves that copy
        b.op(b.t("att16", (B, a, T, T), p, "_to_copy", saved=True), release=[att])
        att = "att16"
    if copies:
        b.op(b.t("v", (B, a, T, hd), p, "clone", saved=True))
    b.op(_core_out(b, out, (B, a, T, hd), p, "bmm", mm), release=[att, "v"])


def _core_math(b: _Builder, out: str) -> None:
    """SDPA's math fallback (CPU, dropout > 0): computes in fp32 whatever the input dtype; keeps fp32 T×T tensors."""
    sh = b.sh
    B, T, a, hd, p = sh.batch, sh.seq, sh.n_head, sh.head_dim, sh.compute
    f = "fp32"
    up = p != f
    mm = 2 * B * a * T * T * hd
    if up:  # with no reshape copy, the bmm saves the upcast v itself
        b.op(*(b.t(f"{n}32", (B, a, T, hd), f, "_to_copy") for n in ("q", "k")))
        b.op(b.t("v32" if sh.merge_copies else "vc", (B, a, T, hd), f, "_to_copy", saved=not sh.merge_copies))
    copies = sh.merge_copies  # without the reshape copies, the bmm saves the scaled q and k (and v) themselves
    b.op(b.t("qs" if copies else "qc", (B, a, T, hd), f, "mul", saved=not copies))
    b.op(b.t("ones", (T, T), "bool", "ones"))
    b.op(b.t("tril", (T, T), "bool", "tril"), release=["ones"])
    b.op(b.t("bias_tt", (T, T), f, "where"), release=["tril"])
    b.op(b.t("ks" if copies else "kc", (B, a, hd, T), f, "mul", saved=not copies))
    if copies:
        b.op(b.t("qc", (B, a, T, hd), f, "clone", saved=True))
        b.op(b.t("kc", (B, a, hd, T), f, "clone", saved=True))
    b.op(b.t("scores", (B, a, T, T), f, "bmm", flops=mm), release=["ks", "qc", "kc"])
    b.op(b.t("biased", (B, a, T, T), f, "add"), release=["scores"])
    b.op(b.t("softmax", (B, a, T, T), f, "_safe_softmax", saved=True), release=["biased"])
    _dropout(b, "attn_drop", (B, a, T, T), f, release=["softmax"], out_saved=True)
    if up:  # the attention weights it returns, cast back (dropped with the rest)
        b.op(b.t("attn_w", (B, a, T, T), p, "_to_copy"))
    if copies:
        b.op(b.t("vc", (B, a, T, hd), f, "clone", saved=True))
    if up:
        b.op(b.t("o32", (B, a, T, hd), f, "bmm", flops=mm), release=["vc"])
        b.op(_core_out(b, out, (B, a, T, hd), p, "_to_copy"))
    else:
        b.op(_core_out(b, out, (B, a, T, hd), p, "bmm", mm), release=["vc"])
    b.op(release=["q32", "k32", "v32", "qs", "bias_tt", "attn_w", "attn_drop.out", "o32"])


def _core_out(b: _Builder, name: str, shape: tuple[int, ...], dtype: str, op: str, flops: int = 0) -> Tensor:
    """The core's output: a temporary, or (one head) already the `y` that c_proj saves, outside the core."""
    if name == "y":
        return b.t(name, shape, dtype, op, saved=True, region="", flops=flops)
    return b.t(name, shape, dtype, op, flops=flops)


def block_forward(sh: Shapes, i: int) -> list[Step]:
    """Every tensor block i creates in forward, in order (models/gpt.py: Block, CausalSelfAttention, MLP).

    Its input `b{i}.x` was made by the block before; its output `b{i+1}.x` belongs to the next block.
    """
    b = _Builder(sh, f"b{i}.")
    B, T, C, a, hd, N = sh.batch, sh.seq, sh.n_embd, sh.n_head, sh.head_dim, sh.tokens
    p, r = sh.compute, sh.param
    kernel = sh.attn_kernel

    # x = x + attn(ln_1(x))
    _layernorm(b, "ln1", (B, T, C), out_saved=not sh.autocast)
    # q, k, v are views of qkv: autograd keeps it when a kernel saves the views themselves
    qkv_saved = kernel == "fused" or (not sh.merge_copies and (kernel == "eager" or p == "fp32"))
    _linear(b, "c_attn", r, C, b.t("qkv", (B, T, 3 * C), p, "addmm", saved=qkv_saved, flops=6 * N * C * C))
    b.region = "core"
    if kernel == "fused":  # one kernel, no T×T: keeps q, k, v (views of qkv), the output and the logsumexp
        lse_t = -(-T // 32) * 32 if sh.sdpa_op == CUDA_EFFICIENT_SDPA else T
        b.op(
            b.t("y", (B, a, T, hd), p, sh.sdpa_op, saved=True, flops=4 * B * a * T * T * hd),
            b.t("lse", (B, a, lse_t), "fp32", sh.sdpa_op, saved=True),
        )
        b.region = ""  # its output is laid out (B, T, a, hd): transpose(1, 2).contiguous() copies nothing
    else:
        # y.transpose(1, 2).contiguous() copies, unless one head makes the transpose contiguous already
        out = "yh" if a > 1 else "y"
        _core_eager(b, out) if kernel == "eager" else _core_math(b, out)
        b.region = ""
        if a > 1:
            b.op(b.t("y", (B, T, C), p, "clone", saved=True), release=["yh"])
    _linear(b, "c_proj", p, C, b.t("attn_out", (B, T, C), p, "addmm", flops=2 * N * C * C))
    d = _dropout(b, "resid_drop", (B, T, C), p, release=["attn_out"])
    b.op(release=["ln1", "qkv", "y", "lse"])  # attention's locals, and its argument ln_1(x), die as it returns
    b.op(b.t("xm", (B, T, C), r, "add", saved=True), release=[d or "attn_out"])

    # x = x + mlp(ln_2(x))
    _layernorm(b, "ln2", (B, T, C), out_saved=not sh.autocast)
    _linear(b, "c_fc", r, C, b.t("h", (B, T, 4 * C), p, "addmm", saved=True, flops=8 * N * C * C))
    b.op(b.t("gelu", (B, T, 4 * C), p, "gelu", saved=True), release=["h"])
    _linear(b, "mlp_proj", p, 4 * C, b.t("mlp_out", (B, T, C), p, "addmm", flops=8 * N * C * C))
    b.op(release=["gelu"])
    d = _dropout(b, "mlp_drop", (B, T, C), p, release=["mlp_out"])
    b.op(release=["ln2"])
    b.op(b.t(f"@b{i + 1}.x", (B, T, C), r, "add", saved=True), release=[d or "mlp_out", "xm", f"@b{i}.x"])
    return b.steps


def embed_forward(sh: Shapes) -> list[Step]:
    """wte(idx) + wpe(arange(T)), then dropout: the first block's input, in the parameter dtype (never autocast)."""
    b = _Builder(sh, "emb.")
    B, T, C, r = sh.batch, sh.seq, sh.n_embd, sh.param
    b.op(b.t("pos", (T,), "int64", "arange", saved=True))
    b.op(b.t("tok", (B, T, C), r, "embedding"), b.t("wpe", (T, C), r, "embedding"))
    if sh.dropout > 0:
        b.op(b.t("sum", (B, T, C), r, "add"), release=["tok", "wpe"])
        _dropout(b, "drop", (B, T, C), r, release=["sum"], out="@b0.x", out_saved=True)
    else:
        b.op(b.t("@b0.x", (B, T, C), r, "add", saved=True), release=["tok", "wpe"])
    return b.steps


def head_forward(sh: Shapes) -> list[Step]:
    """ln_f → lm_head (tied to wte, no bias) → logits.float() → cross-entropy. The logits die when forward returns
    (the training step keeps only the loss); log_softmax keeps its fp32 output for backward."""
    b = _Builder(sh, "head.")
    B, T, C, V, N, L = sh.batch, sh.seq, sh.n_embd, sh.vocab, sh.tokens, sh.n_layer
    p = sh.compute
    _layernorm(b, "ln_f", (B, T, C), out_saved=not sh.autocast)
    _linear(b, "lm_head", sh.param, C, b.t("logits", (B, T, V), p, "mm", flops=2 * N * C * V), bias=False)
    b.op(release=["ln_f"])  # a temporary of GPT.forward, gone once lm_head returns
    if p != "fp32":
        b.op(b.t("logits32", (N, V), "fp32", "_to_copy"))
    b.op(b.t("logsoftmax", (N, V), "fp32", "_log_softmax", saved=True))
    b.op(b.t("loss", (), "fp32", "nll_loss_forward"), b.t("total_weight", (), "fp32", "nll_loss_forward", saved=True))
    b.op(release=["logits32", "logits", "logsoftmax", f"@b{L}.x"])
    return b.steps


# -- backward pieces -----------------------------------------------------------------------------------


def _linear_backward(
    b: _Builder, name: str, grad: str, x_saved: str | None, dx: Tensor, fin: int, fout: int, free_grad: bool = True
) -> None:
    """addmm/mm backward: dx, and dW/db, which under autocast are compute-dtype temporaries cast to the fp32 .grad
    (without autocast they are the .grad itself: not activation memory)."""
    sh = b.sh
    release = [grad] if free_grad else []
    release += [x_saved] if x_saved else []
    flops = 4 * sh.tokens * fin * fout
    grads = [b.t(f"{name}.gw", (fout, fin), sh.param, "mm", grad=True)]
    if sh.bias:
        grads.append(b.t(f"{name}.gb", (fout,), sh.param, "sum", grad=True))
    if not sh.autocast:  # dW and db are the .grad themselves
        b.bwd(dx, *grads, release=release, flops=flops)
        return
    temps = [b.t(f"{name}.dw16", (fout, fin), sh.compute, "mm")]
    if sh.bias:
        temps.append(b.t(f"{name}.db16", (1, fout), sh.compute, "sum"))
    b.bwd(dx, *temps, release=[*release, f"{name}.w16"], flops=flops)
    b.bwd(*grads, release=["@" + t.name for t in temps])  # ToCopyBackward: cast into the parameter's fp32 .grad


def _branch_grad(b: _Builder, g: str, tag: str, drop: str, first: bool) -> str:
    """AddBackward hands the residual gradient to the branch (cast to the branch's dtype), then dropout's backward."""
    sh = b.sh
    shape = (sh.batch, sh.seq, sh.n_embd)
    cur = g
    if sh.param != sh.compute:
        b.bwd(b.t(f"{tag}.g16", shape, sh.compute, "_to_copy"))
        cur = f"{tag}.g16"
    if first:
        b.recompute_point()  # the block's first unpack of a saved tensor: a checkpoint recomputes here
    if sh.dropout > 0:
        b.bwd(b.t(f"{tag}.gd", shape, sh.compute, "mul"), release=[f"{drop}.mask"] + ([cur] if cur != g else []))
        cur = f"{tag}.gd"
    return cur


def _layernorm_backward(b: _Builder, name: str, grad: str, x: str, out: str) -> None:
    sh = b.sh
    shape = (sh.batch, sh.seq, sh.n_embd)
    if sh.autocast:  # ToCopyBackward of the linear's input cast: the gradient back to fp32
        b.bwd(b.t(f"{name}.g32", shape, sh.param, "_to_copy"), release=[grad])
        grad = f"{name}.g32"
    op = "native_layer_norm_backward"
    grads = [b.t(f"{name}.g{w}", (sh.n_embd,), sh.param, op, grad=True) for w in ("w", "b")[: 1 + sh.bias]]
    b.bwd(b.t(out, shape, sh.param, op), *grads, release=[grad, x, f"{name}.mean", f"{name}.rstd"])


def _core_eager_backward(b: _Builder) -> None:
    sh = b.sh
    B, T, a, hd, p, smt = sh.batch, sh.seq, sh.n_head, sh.head_dim, sh.compute, sh.softmax_dtype
    mm2 = 4 * B * a * T * T * hd  # two bmm per bmm backward
    dy = "dy"
    if sh.merge_copies:  # the head-split gradient is reshaped to (B·a, T, d) for the bmm: a copy
        b.bwd(b.t("dyh", (B, a, T, hd), p, "clone"), release=["dy"])
        dy = "dyh"
    b.recompute_point()  # selective: the core's first unpack
    att = "att16" if smt != p else ("attn_drop.out" if sh.dropout > 0 else "softmax")
    b.bwd(b.t("dv", (B, a, T, hd), p, "bmm"), b.t("datt", (B, a, T, T), p, "bmm"), release=[dy, att, "v"], flops=mm2)
    cur = "datt"
    if smt != p:
        b.bwd(b.t("datt32", (B, a, T, T), smt, "_to_copy"), release=[cur])
        cur = "datt32"
    if sh.dropout > 0:
        b.bwd(b.t("dsm", (B, a, T, T), smt, "mul"), release=[cur, "attn_drop.mask", "attn_drop.out"])
        cur = "dsm"
    b.bwd(b.t("dmasked", (B, a, T, T), smt, "_softmax_backward_data"), release=[cur, "softmax"])
    cur = "dmasked"
    if smt != p:
        b.bwd(b.t("dmasked16", (B, a, T, T), p, "_to_copy"), release=[cur])
        cur = "dmasked16"
    b.bwd(b.t("dscaled", (B, a, T, T), p, "masked_fill"), release=[cur, "causal"])
    b.bwd(b.t("dscores", (B, a, T, T), p, "mul"), release=["dscaled"])
    b.bwd(
        b.t("dkT", (B, a, hd, T), p, "bmm"),
        b.t("dq", (B, a, T, hd), p, "bmm"),
        release=["dscores", "q", "k", "qkv"],  # qkv: when the bmm saved views of it (batch 1 or one head)
        flops=mm2,
    )
    _head_merge(b, "dv", "dq", "dkT")


def _core_math_backward(b: _Builder) -> None:
    sh = b.sh
    B, T, a, hd, p = sh.batch, sh.seq, sh.n_head, sh.head_dim, sh.compute
    f = "fp32"
    up = p != f
    mm2 = 4 * B * a * T * T * hd
    dy = "dy"
    if up:
        b.bwd(b.t("dy32", (B, a, T, hd), f, "_to_copy"), release=[dy])
        dy = "dy32"
    if sh.merge_copies:
        b.bwd(b.t("dyc", (B, a, T, hd), f, "clone"), release=[dy])
        dy = "dyc"
    b.recompute_point()
    b.bwd(
        b.t("dv", (B, a, T, hd), f, "bmm"),
        b.t("datt", (B, a, T, T), f, "bmm"),
        release=[dy, "attn_drop.out", "vc"],
        flops=mm2,
    )
    b.bwd(b.t("dsm", (B, a, T, T), f, "mul"), release=["datt", "attn_drop.mask"])
    b.bwd(b.t("dbiased", (B, a, T, T), f, "_softmax_backward_data"), release=["dsm", "softmax"])
    b.bwd(
        b.t("dkT", (B, a, hd, T), f, "bmm"),
        b.t("dqs", (B, a, T, hd), f, "bmm"),
        release=["dbiased", "qc", "kc", "qkv"],
        flops=mm2,
    )
    b.bwd(b.t("dks", (B, a, hd, T), f, "mul"), release=["dkT"])
    b.bwd(b.t("dq32", (B, a, T, hd), f, "mul"), release=["dqs"])
    parts = ["dv", "dks", "dq32"]
    if up:
        b.bwd(b.t("dv16", (B, a, T, hd), p, "_to_copy"), release=["dv"])
        b.bwd(b.t("dk16", (B, a, hd, T), p, "_to_copy"), release=["dks"])
        b.bwd(b.t("dq16", (B, a, T, hd), p, "_to_copy"), release=["dq32"])
        parts = ["dv16", "dk16", "dq16"]
    _head_merge(b, parts[0], parts[2], parts[1])


def _head_merge(b: _Builder, dv: str, dq: str, dk: str) -> None:
    """The q/k/v gradients back through transpose and view into one (B, T, 3C) tensor for c_attn's backward: v's and
    q's need a contiguous copy first when there are several heads (k's transposed layout already fits)."""
    sh = b.sh
    B, T, a, hd = sh.batch, sh.seq, sh.n_head, sh.head_dim
    if a > 1:
        b.bwd(b.t("dv_c", (B, T, a, hd), sh.compute, "clone"), release=[dv])
        b.bwd(b.t("dq_c", (B, T, a, hd), sh.compute, "clone"), release=[dq])
        dv, dq = "dv_c", "dq_c"
    b.bwd(b.t("dqkv", (B, T, 3 * sh.n_embd), sh.compute, "cat"), release=[dv, dq, dk])


def block_backward(sh: Shapes, i: int) -> list[Step]:
    """Block i's backward, node by node in autograd's order: the gradients it allocates and what each node releases.

    It receives `g{i+1}` (the gradient of its output) and leaves `g{i}`. Two `recompute_point`s mark where torch
    runs a pending recompute: the block's first unpack (checkpoint, SAC) and the core attention's (selective).
    """
    b = _Builder(sh, f"b{i}.")
    B, T, C, a, hd = sh.batch, sh.seq, sh.n_embd, sh.n_head, sh.head_dim
    p, r = sh.compute, sh.param
    g_out = f"@g{i + 1}"
    kernel = sh.attn_kernel
    in16 = (lambda n: f"{n}.in16") if sh.autocast else (lambda n: n)

    # the MLP half
    gm = _branch_grad(b, g_out, "mlp", "mlp_drop", first=True)
    _linear_backward(b, "mlp_proj", gm, "gelu", b.t("dgelu", (B, T, 4 * C), p, "mm"), 4 * C, C, free_grad=gm != g_out)
    b.bwd(b.t("dh", (B, T, 4 * C), p, "gelu_backward"), release=["dgelu", "h"])
    _linear_backward(b, "c_fc", "dh", in16("ln2"), b.t("dln2", (B, T, C), p, "mm"), C, 4 * C)
    _layernorm_backward(b, "ln2", "dln2", "xm", "dxm")
    b.bwd(b.t("gm", (B, T, C), r, "add"), release=[g_out, "dxm"])  # the residual's two contributions, summed

    # the attention half
    ga = _branch_grad(b, "gm", "attn", "resid_drop", first=False)
    y_saved = None if kernel == "fused" else "y"  # the fused kernel's output is also saved by its own backward
    _linear_backward(b, "c_proj", ga, y_saved, b.t("dy", (B, T, C), p, "mm"), C, C, free_grad=ga != "gm")
    if kernel == "eager":
        _core_eager_backward(b)
    elif kernel == "math":
        _core_math_backward(b)
    else:
        b.bwd(
            *(b.t(f"d{n}", (B, a, T, hd), p, sh.sdpa_op + "_backward") for n in "qkv"),
            release=["dy", "qkv", "y", "lse"],
            flops=10 * B * a * T * T * hd,  # recomputes QKᵀ, then dV, dP, dQ, dK
        )
        b.bwd(b.t("dqkv", (B, T, 3 * C), p, "cat"), release=["dq", "dk", "dv"])
    _linear_backward(b, "c_attn", "dqkv", in16("ln1"), b.t("dln1", (B, T, C), p, "mm"), C, 3 * C)
    _layernorm_backward(b, "ln1", "dln1", f"@b{i}.x", "dx")
    b.bwd(b.t(f"@g{i}", (B, T, C), r, "add"), release=["gm", "dx"])
    return b.steps


def head_backward(sh: Shapes) -> list[Step]:
    b = _Builder(sh, "head.")
    B, T, C, V, N, L = sh.batch, sh.seq, sh.n_embd, sh.vocab, sh.tokens, sh.n_layer
    p, r = sh.compute, sh.param
    b.bwd(b.t("seed", (), "fp32", "ones_like"))  # loss.backward()'s grad seed, alive until backward returns
    b.bwd(b.t("dlogsoftmax", (N, V), "fp32", "nll_loss_backward"), release=["total_weight"])
    b.bwd(b.t("dlogits32", (N, V), "fp32", "_log_softmax_backward_data"), release=["dlogsoftmax", "logsoftmax"])
    grad = "dlogits32"
    if p != "fp32":
        b.bwd(b.t("dlogits", (N, V), p, "_to_copy"), release=[grad])
        grad = "dlogits"
    flops = 4 * N * C * V
    # The tied wte/lm_head weight: its first gradient contribution waits in autograd's input buffer until the
    # embedding's backward adds the second; only the sum becomes .grad, so the tracker counts the buffer.
    if sh.autocast:
        b.bwd(
            b.t("dw16", (V, C), p, "mm"),
            b.t("dx", (B, T, C), p, "mm"),
            release=[grad, "lm_head.in16", "lm_head.w16"],
            flops=flops,
        )
        b.bwd(b.t("dx32", (B, T, C), r, "_to_copy"), release=["dx"])
        b.bwd(b.t("@tied_grad", (V, C), r, "_to_copy"), release=["dw16"])
        grad = "dx32"
    else:
        b.bwd(b.t("@tied_grad", (V, C), r, "mm"), b.t("dx", (B, T, C), p, "mm"), release=[grad, "ln_f"], flops=flops)
        grad = "dx"
    op = "native_layer_norm_backward"
    b.bwd(
        b.t(f"@g{L}", (B, T, C), r, op),
        *(b.t(f"ln_f.g{w}", (C,), r, op, grad=True) for w in ("w", "b")[: 1 + sh.bias]),
        release=[grad, f"@b{L}.x", "ln_f.mean", "ln_f.rstd"],
    )
    return b.steps


def embed_backward(sh: Shapes) -> list[Step]:
    b = _Builder(sh, "emb.")
    B, T, C, V, r = sh.batch, sh.seq, sh.n_embd, sh.vocab, sh.param
    g = "@g0"
    if sh.dropout > 0:
        b.bwd(b.t("gd", (B, T, C), r, "mul"), release=[g, "drop.mask"])
        g = "gd"
    b.bwd(b.t("gpos", (1, T, C), r, "sum"))  # wpe: summed over the batch, then its .grad
    b.bwd(
        b.t("gwpe", (sh.block_size, C), r, "embedding_dense_backward", grad=True),
        b.t("gwte", (V, C), r, "embedding_dense_backward"),
        release=["gpos"],
    )
    # gwte + the buffered lm_head part: their sum becomes wte's .grad
    b.bwd(b.t("gwte_sum", (V, C), r, "add", grad=True), release=["gwte", "@tied_grad", g, "pos"])
    return b.steps


# ----------------------------------------------------------------------------------------------------
# The replay: a live-bytes timeline over one micro-batch's forward and backward under a Plan.
# ----------------------------------------------------------------------------------------------------

# What is live at the peak, by kind. The activation peak is the sum of all but "gradients" (the parameters'
# gradients: last step's while the forward runs, then each .grad as backward makes it) and "batch" (a later
# micro-batch's input, loaded inside the step), which the step's peak adds.
KINDS = ("activations", "recompute", "backward", "logits_loss", "weight_copies", "tied_grad", "gradients", "batch")
_LOGITS = re.compile(r"head\.(d?logits|d?logsoftmax|loss|total_weight|seed|dlogits32)")


def _kind_of(t: Tensor, phase: str) -> str:
    if t.grad:
        return "gradients"
    if t.name == "tied_grad":
        return "tied_grad"
    if t.cached:
        return "weight_copies"
    if _LOGITS.match(t.name):
        return "logits_loss"
    return phase


@dataclass
class _Live:
    tensor: Tensor
    kind: str
    block: int | None


class Timeline:
    """Live bytes by kind, and two peaks, each with where it happened and what it was made of: the activation peak
    (`peak`: every kind but the parameters' gradients, what the live-tensor tracker reports as the activation peak)
    and the step's (`step_peak`: gradients included; parameters and optimizer state are not in the timeline)."""

    def __init__(self) -> None:
        self.live: dict[str, _Live] = {}
        self.by_kind: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.bytes = 0
        self.peak = 0
        self.peak_kinds = dict(self.by_kind)
        self.peak_where = ""
        self.step_peak = 0
        self.step_peak_kinds = dict(self.by_kind)
        self.step_peak_where = ""
        self.where = ""
        self.deferred: set[str] = set()  # released but still held by the autocast cache until autocast exits
        self.flops = {"forward": 0, "backward": 0, "recompute": 0}
        self.recompute_peak = 0

    def alloc(self, t: Tensor, kind: str) -> None:
        if t.name in self.live:
            raise AssertionError(f"estimator bug: {t.name} allocated twice")
        m = re.match(r"b(\d+)\.", t.name)
        self.live[t.name] = _Live(t, kind, int(m.group(1)) if m else None)
        self.bytes += t.nbytes
        self.by_kind[kind] += t.nbytes
        self.recompute_peak = max(self.recompute_peak, self.by_kind["recompute"])
        activation = self.bytes - self.by_kind["gradients"] - self.by_kind["batch"]
        if activation > self.peak:
            self.peak, self.peak_kinds, self.peak_where = activation, dict(self.by_kind), self.where
        if self.bytes > self.step_peak:
            self.step_peak, self.step_peak_kinds, self.step_peak_where = self.bytes, dict(self.by_kind), self.where

    def free(self, name: str) -> None:
        e = self.live.pop(name, None)
        if e is not None:
            self.deferred.discard(name)
            self.bytes -= e.tensor.nbytes
            self.by_kind[e.kind] -= e.tensor.nbytes

    def autocast_exit(self) -> None:
        for name in sorted(self.deferred):
            self.free(name)

    def bytes_of(self, block: int | None = None, kinds: Iterable[str] = ("activations",)) -> int:
        ks = set(kinds)
        return sum(e.tensor.nbytes for e in self.live.values() if e.kind in ks and (block is None or e.block == block))


def _last_saved_step(steps: Sequence[Step], exclude: str = "") -> int:
    """Non-reentrant checkpoint stops its recompute once every saved tensor is back: at the last op saving one."""
    return max((k for k, s in enumerate(steps) if any(t.saved and t.name != exclude for t in s.alloc)), default=-1)


def _op_name(name: str) -> str:
    """'aten.mm' | 'aten.mm.default' | 'mm' → 'mm' (what SAC's save list matches: every overload of the packet)."""
    parts = str(name).split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "aten" else parts[0]


class Replay:
    """One micro-batch of the GPT under a Plan, replayed tensor by tensor on a Timeline, in Lightning's order.

    Forward, with last step's gradients alive (Lightning zeroes them after `training_step`): the embedding, each
    segment's blocks (each treatment decides which tensors survive), the head; with the autocast cache on, it lets
    go of its weight copies when forward ends. Then zero_grad. Backward: the head, then the segments in reverse,
    each recompute run where torch triggers it, then the embedding; each parameter's .grad appears where its
    gradient is made. `accumulating`: a micro-batch after the first of an accumulated step, which runs with every
    .grad alive throughout and sums each new gradient into it (the new one is a temporary), and whose input and
    targets were loaded inside the step.
    """

    def __init__(
        self,
        sh: Shapes,
        plan: Plan,
        save_ops: Iterable[str] = (),
        min_bytes: int = 1 << 16,
        accumulating: bool = False,
    ) -> None:
        self.sh, self.plan = sh, plan
        self.accumulating = accumulating
        self.save = frozenset(_op_name(o) for o in save_ops)
        self.min_bytes = min_bytes
        self.offload_moves = sh.device == "cuda"  # on CPU the offloader is a no-op
        self.tl = Timeline()
        self.programs = {i: block_forward(sh, i) for i in range(sh.n_layer)}
        self.offloaded: dict[int, dict[str, Tensor]] = {}
        self.per_block: list[int] = []
        self.kept_total = 0
        self.host_bytes = 0

    # -- running programs ------------------------------------------------------------------------------

    def run(
        self,
        steps: Sequence[Step],
        phase: str,
        keep: Callable[[Tensor], bool] = lambda t: False,
        on_recompute_point: Callable[[], None] | None = None,
    ) -> None:
        """Allocate each step's tensors; on release, free what `keep` does not hold for backward (forward-like
        phases) or everything (backward). The autocast cache, when on, holds weight copies until `autocast_exit`."""
        tl = self.tl
        cache = self.sh.autocast_cache
        for s in steps:
            if s.recompute_point:
                if on_recompute_point is not None:
                    on_recompute_point()
                continue
            for t in s.alloc:
                if t.name in tl.live:  # SAC replays its cached outputs: no op runs, nothing is allocated
                    continue
                tl.alloc(t, _kind_of(t, "activations" if phase == "forward" else phase))
                tl.flops[phase] += t.flops
            tl.flops[phase] += s.flops
            for name in s.release:
                e = tl.live.get(name)
                if e is None or (phase != "backward" and keep(e.tensor)):
                    continue
                if cache and e.tensor.cached and phase != "backward":
                    tl.deferred.add(name)
                else:
                    tl.free(name)
            if self.accumulating:  # summed into the existing .grad in place, then let go of
                for t in s.alloc:
                    if t.grad:
                        tl.free(t.name)

    def keep_rule(self, mode: str, group_start: int, i: int) -> Callable[[Tensor], bool]:
        """What block i (in a segment starting at group_start) keeps from forward for backward."""
        group_input = f"b{group_start}.x"
        if mode == "store":
            if i in self.plan.selective_blocks:  # the core's checkpoint keeps its inputs q, k, v: views of qkv
                return lambda t: (t.saved and t.region != "core") or t.name == f"b{i}.qkv"
            return lambda t: t.saved
        if mode == "checkpoint":
            return lambda t: t.name == group_input
        if mode == "op_sac":
            return lambda t: t.name == group_input or (t.op in self.save and not t.cached)
        if mode == "offload":
            if not self.offload_moves:
                return lambda t: t.saved

            def keep(t: Tensor) -> bool:
                if t.saved and t.nbytes >= self.min_bytes:
                    self.offloaded.setdefault(i, {})[t.name] = t  # to host; freed here, back in backward
                    return False
                return t.saved

            return keep
        raise AssertionError(mode)

    # -- the step --------------------------------------------------------------------------------------

    def forward(self) -> None:
        sh, tl = self.sh, self.tl
        # last step's gradients (all of them: every parameter trains), alive until zero_grad
        tl.alloc(Tensor("grads", (parameter_count(sh),), sh.param, "", grad=True), "gradients")
        if self.accumulating:  # this micro-batch's input and targets, loaded during the step (the first's before it)
            tl.alloc(Tensor("batch", (2, sh.batch, sh.seq), "int64", ""), "batch")
        tl.where = "forward: embedding"
        self.run(embed_forward(sh), "forward", lambda t: t.saved)
        for seg in self.plan.segments:
            for i in range(seg.start, seg.stop):
                tl.where = f"forward: block {i}"
                self.run(self.programs[i], "forward", self.keep_rule(seg.mode, seg.start, i))
        tl.where = "forward: head and loss"
        self.run(head_forward(sh), "forward", lambda t: t.saved)
        tl.autocast_exit()
        if not self.accumulating:
            tl.free("grads")  # zero_grad(set_to_none=True), between training_step and backward
        self.per_block = [tl.bytes_of(i) for i in range(sh.n_layer)]
        self.kept_total = tl.bytes_of()
        self.host_bytes = sum(t.nbytes for kept in self.offloaded.values() for t in kept.values())

    def backward(self) -> None:
        sh, tl = self.sh, self.tl
        tl.where = "backward: loss and lm_head"
        self.run(head_backward(sh), "backward")
        for seg in reversed(self.plan.segments):
            pending = seg.mode in ("checkpoint", "op_sac")
            for i in reversed(range(seg.start, seg.stop)):
                tl.where = f"backward: block {i}"
                if seg.mode == "offload":
                    for j in (i, i - 1):  # this block's tensors come back; the previous block's are prefetched
                        for t in self.offloaded.pop(j, {}).values():
                            tl.alloc(t, _kind_of(t, "activations"))
                points = 0

                def at_point(i: int = i, seg: Any = seg) -> None:
                    nonlocal pending, points
                    points += 1
                    if points == 1 and pending:
                        pending = False
                        self.recompute(list(range(seg.start, seg.stop)), f"b{seg.stop}.x")
                        tl.autocast_exit()  # the recompute's own autocast context exits
                    elif points == 2 and i in self.plan.selective_blocks:
                        core = [s for s in self.programs[i] if s.region == "core"]
                        self.recompute_steps(core, "", f"block {i}'s core attention")
                    tl.where = f"backward: block {i}"

                self.run(block_backward(sh, i), "backward", on_recompute_point=at_point)
                # whatever of block i is still here dies with its graph nodes (e.g. a SAC cache's unreplayed tail)
                for name in [n for n, e in tl.live.items() if e.block == i and not e.tensor.grad]:
                    tl.free(name)
        tl.where = "backward: embedding"
        self.run(embed_backward(sh), "backward")

    def recompute(self, blocks: list[int], output: str) -> None:
        """A checkpointed segment's forward again, minus its output (not saved inside the segment)."""
        steps = [s for j in blocks for s in self.programs[j]]
        label = f"blocks {blocks[0]}-{blocks[-1]}" if len(blocks) > 1 else f"block {blocks[0]}"
        self.recompute_steps(steps, output, label)

    def recompute_steps(self, steps: Sequence[Step], exclude: str, label: str) -> None:
        self.tl.where = f"backward: recompute of {label}"
        stop = _last_saved_step(steps, exclude)
        ran = steps[: stop + 1]
        self.run(ran, "recompute", lambda t: t.saved)
        # The early stop raises out of the recomputed forward: its locals die (SAC's replayed cache entries too);
        # only what autograd saved stays.
        for name in {t.name for s in ran for t in s.alloc if not t.saved} - self.tl.deferred:
            self.tl.free(name)


def simulate(
    sh: Shapes, plan: Plan, save_ops: Iterable[str] = (), min_bytes: int = 1 << 16, accumulating: bool = False
) -> Replay:
    """Replay one micro-batch's forward and backward; the Replay holds the timeline, per-block bytes and FLOPs."""
    r = Replay(sh, plan, save_ops, min_bytes, accumulating)
    r.forward()
    r.backward()
    return r


def block_inventory(
    sh: Shapes, treatment: str, save_ops: Iterable[str] | None = None, min_bytes: int = 1 << 16
) -> list[Tensor]:
    """What one block keeps from its forward until its backward under a treatment (none | full | selective |
    op_sac | offload), tensor by tensor: its input (the residual stream), its saved activations and, under
    autocast, the weight copies saved for backward. op_sac uses the policy's default save list unless given one;
    offload lists what stays on the device (everything on CPU)."""
    from trainer.policies import DEFAULT_SAC_SAVE_OPS, Segment

    mode = {"none": "store", "selective": "store", "full": "checkpoint", "op_sac": "op_sac", "offload": "offload"}
    if treatment not in mode:
        raise ValueError(f"treatment {treatment!r}; choose from {', '.join(mode)}")
    selective = frozenset({0}) if treatment == "selective" and sh.attention == "eager" else frozenset()
    plan = Plan(tuple(Segment(j, j + 1, mode[treatment]) for j in range(sh.n_layer)), selective)
    r = Replay(sh, plan, DEFAULT_SAC_SAVE_OPS if save_ops is None else save_ops, min_bytes)
    r.forward()
    return [e.tensor for e in r.tl.live.values() if e.block == 0]


# ----------------------------------------------------------------------------------------------------
# Parameters, optimizer state, and the Estimate.
# ----------------------------------------------------------------------------------------------------


def parameter_count(sh: Shapes) -> int:
    """GPT parameters as models/gpt.py builds them, the lm_head tied to wte (counted once)."""
    C, V, L = sh.n_embd, sh.vocab, sh.n_layer
    bias = 1 if sh.bias else 0
    ln = C * (1 + bias)
    linears = 12 * C * C + 9 * C * bias  # c_attn 3C², c_proj C², c_fc 4C², mlp c_proj 4C² (+ biases)
    return V * C + sh.block_size * C + L * (2 * ln + linears) + ln


def buffer_bytes(sh: Shapes) -> int:
    """The model's buffers: each attention's causal mask, block_size² bools (registered for sdpa too)."""
    return sh.n_layer * sh.block_size**2


def _param_groups(sh: Shapes) -> tuple[list[int], list[int]]:
    """Element counts of trainer.module.param_groups' two AdamW groups, in model.parameters() order: the decayed
    matmul weights, and the rest (embeddings, LayerNorms, biases)."""
    C, L = sh.n_embd, sh.n_layer
    ln = [C, C] if sh.bias else [C]
    decay = [3 * C * C, C * C, 4 * C * C, 4 * C * C] * L
    per_block = [*ln, *([3 * C, C] if sh.bias else []), *ln, *([4 * C, C] if sh.bias else [])]
    return decay, [sh.vocab * C, sh.block_size * C, *per_block * L, *ln]


def optimizer_step_bytes(sh: Shapes) -> int:
    """What AdamW.step() allocates on top of its state (activations are gone by then; the gradients are not).
    foreach (the CUDA default): √exp_avg_sq for a whole param group at once; single-tensor (CPU): √exp_avg_sq and
    its quotient for one parameter while the previous parameter's is still bound."""
    state = DTYPE_BYTES[sh.param]
    groups = _param_groups(sh)
    if sh.device == "cuda":
        return max(sum(g) for g in groups) * state
    return max(max(2 * n + (g[k - 1] if k else 0) for k, n in enumerate(g)) for g in groups if g) * state


@dataclass
class Estimate:
    """One configuration under one policy, on one device. FLOPs are per optimizer step (× accum micro-batches).

    `activation_bytes` is what the live-tensor tracker reports as the activation peak of one micro-batch
    (`peak_bytes_excluding` the parameter gradients; train.py's memory/activation_peak_mib): activations,
    recompute, gradients in flight, logits/loss, autocast weight copies and the tied weight's buffered gradient, at
    the moment they peak together.

    `peak_bytes` is the whole optimizer step's peak as train.py reports it (memory/peak_total_mib: the tracker with
    the training state adopted, in steady state): parameters + buffers + AdamW state, plus the largest of
    * forward + backward replayed in Lightning's order: the forward with last step's gradients alive, zero_grad,
      then the backward creating each .grad where its gradient is made (with accumulation, the later
      micro-batches with every .grad alive);
    * the optimizer step: every gradient and AdamW.step()'s temporaries (clipping makes only scalars).
    `components` breaks the activation peak down, gives the resident state, the optimizer temporaries, and the
    step peak's gradients (`step_peak_gradients`) and other in-step bytes (`step_peak_in_flight`);
    `step_peak_at` says where the step peaks. The first step peaks lower (no gradients or AdamW state yet).
    """

    policy: str
    plan: str
    device: str
    activation_bytes: int
    peak_bytes: int
    components: dict[str, int]
    per_block: list[int]  # activation bytes each block keeps from its forward to its backward
    kept_bytes: int  # all activations kept at the end of forward (embedding, blocks, head)
    recompute_transient_bytes: int  # the most bytes that recomputed tensors hold at once
    fwd_flops: int
    bwd_flops: int
    recompute_flops: int
    peak_at: str  # where in the step the activation peak happens
    step_peak_at: str = ""  # where the whole step's peak (peak_bytes) happens
    host_bytes: int = 0  # pinned host memory the offload policy fills (CUDA)
    micro_batches: int = 1
    autocast_cache: bool = False  # modelled with autocast's weight cache on (a bare loop), not off (train.py)
    notes: list[str] = field(default_factory=list)

    @property
    def flops(self) -> int:
        return self.fwd_flops + self.bwd_flops + self.recompute_flops

    def fits(self, budget_bytes: int | None) -> bool | None:
        return None if budget_bytes is None else self.peak_bytes <= budget_bytes

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "flops": self.flops}


def shapes_of(config: Config, device: str = "cpu", autocast_cache: bool = False) -> tuple[Shapes, list[str]]:
    """The Shapes of a validated config, and the assumption made when the tokenizer decides the vocabulary."""
    notes = []
    m = config.model
    if m.vocab_size is not None:
        vocab = m.vocab_size
    elif config.data.tokenizer == "byte":
        vocab = 256
        notes.append("vocab_size 256 from data.tokenizer=byte (model.vocab_size is null; set it to override)")
    else:
        vocab = config.data.bpe_vocab_size
        notes.append(
            f"vocab_size {vocab} from data.bpe_vocab_size (model.vocab_size is null; a small corpus may train a "
            "smaller BPE vocabulary, which only lowers the figures)"
        )
    sh = Shapes(
        batch=config.batch_size,
        seq=config.seq_len,
        n_embd=m.n_embd,
        n_head=m.n_head,
        n_layer=m.n_layer,
        vocab=vocab,
        block_size=m.block_size,
        dropout=m.dropout,
        bias=m.bias,
        attention=m.attention,
        precision=config.precision,
        device=device,
        autocast_cache=autocast_cache,
    )
    return sh, notes


@functools.lru_cache(maxsize=16)
def _plan_model(n_layer: int, attention: str) -> Any:
    """A policy plans from a model's `.blocks`: a meta-device GPT of the right depth (no memory, built once)."""
    import torch

    from models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=1, block_size=1, n_layer=n_layer, n_head=1, n_embd=1, attention=attention))


@contextmanager
def _quiet_policy_notices() -> Iterator[None]:
    """Policy checks log one-off notices about the device *this* process runs on; the estimate states its own."""
    import trainer.policies as policies

    log = logging.getLogger(policies.__name__)
    level, said = log.level, set(policies._said)
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)
        policies._said.intersection_update(said)  # a later real run still gets its notice


def estimate_policy(
    config: Config, policy: Policy, device: str = "cpu", plan: Plan | None = None, autocast_cache: bool = False
) -> Estimate:
    """`config` under `policy` (which may differ from config.policy) on `device` ("cpu" | "cuda").

    `plan` replaces the policy's own plan: e.g. the per-block plan a planner chose, to be estimated as it would run.
    `autocast_cache`: model autocast with its weight cache on (a bare loop's default) instead of off (train.py's).
    """
    sh, notes = shapes_of(config, device, autocast_cache)
    with _quiet_policy_notices():
        policy.check(sh.n_layer, sh.attention)
    if plan is None:
        plan = policy.plan(_plan_model(sh.n_layer, sh.attention))
    args = (sh, plan, getattr(policy.cfg, "save_ops", ()), getattr(policy.cfg, "min_bytes", 1 << 16))
    replay = simulate(*args)  # one micro-batch: the first of the step
    tl = replay.tl
    # With accumulation, the later micro-batches run with every gradient alive: their step peak may be higher
    # (their activation peak and FLOPs are the first one's).
    later = simulate(*args, accumulating=True).tl if config.accum > 1 else tl

    n_params = parameter_count(sh)
    pbytes = DTYPE_BYTES[sh.param]
    k = tl.peak_kinds
    components = {
        "parameters": n_params * pbytes,
        "buffers": buffer_bytes(sh),
        "gradients": n_params * pbytes,
        # AdamW's exp_avg and exp_avg_sq: fp32 next to fp32 master weights; in the parameters' dtype for bf16-true
        "optimizer_state": 2 * n_params * pbytes,
        "autocast_weight_copies": k["weight_copies"],
        "activations": k["activations"],
        "recompute_transient": k["recompute"],
        "backward_working_set": k["backward"],
        "logits_loss": k["logits_loss"],
        "tied_grad_buffer": k["tied_grad"],
        "optimizer_step_transient": optimizer_step_bytes(sh),
    }
    # The step's peak: the largest moment of forward + backward (gradients included), or the optimizer step (clip,
    # then AdamW.step()), where every gradient is alive beside AdamW's temporaries and no activation is.
    step = max(tl, later, key=lambda t: t.step_peak)
    candidates = [
        (step.step_peak_kinds["gradients"], step.step_peak - step.step_peak_kinds["gradients"], step.step_peak_where),
        (components["gradients"], components["optimizer_step_transient"], "optimizer step (clip + AdamW.step())"),
    ]
    grads, in_flight, where = max(candidates, key=lambda c: c[0] + c[1])
    components["step_peak_gradients"] = grads
    components["step_peak_in_flight"] = in_flight
    resident = components["parameters"] + components["buffers"] + components["optimizer_state"]
    peak = resident + grads + in_flight
    components["total"] = peak

    name = policy.cfg.name
    treatments = set(policy.treatments(sh.n_layer)) if hasattr(policy, "treatments") else {name}
    if "selective" in treatments and not plan.selective_blocks:
        notes.append(
            "selective with model.attention=sdpa recomputes nothing: the fused kernel keeps no T×T scores, "
            "so attention is stored as under `none`"
            + (" (on CPU with dropout the math fallback does keep them)" if sh.attn_kernel == "math" else "")
        )
    if "offload" in treatments and device == "cpu":
        notes.append("offload on CPU moves nothing: activations already live in host memory")
    if sh.autocast and autocast_cache:
        notes.append(
            "autocast weight cache on (--autocast-cache): a bare loop's default torch.autocast, which holds every "
            "weight cast to the end of the forward; train.py runs with it off"
        )
    elif sh.autocast:
        notes.append(
            "autocast weight cache off, as train.py runs it (Lightning's precision plugin: cache_enabled=False); "
            "--autocast-cache models a bare loop's default torch.autocast"
        )
    notes.append(
        "the total is a steady-state step as train.py runs it: forward with last step's gradients alive, zero_grad, "
        "backward, clip, AdamW.step() (the first step peaks lower)"
    )
    accum = config.accum
    return Estimate(
        policy=name,
        plan=plan.describe(),
        device=device,
        activation_bytes=tl.peak,
        peak_bytes=peak,
        components=components,
        per_block=replay.per_block,
        kept_bytes=replay.kept_total,
        recompute_transient_bytes=tl.recompute_peak,
        fwd_flops=tl.flops["forward"] * accum,
        bwd_flops=tl.flops["backward"] * accum,
        recompute_flops=tl.flops["recompute"] * accum,
        peak_at=tl.peak_where,
        step_peak_at=where,
        host_bytes=replay.host_bytes,
        micro_batches=accum,
        autocast_cache=autocast_cache,
        notes=notes,
    )


def estimate(config: Config, device: str = "cpu", autocast_cache: bool = False) -> Estimate:
    """The configured policy (config.policy) on `device`."""
    return estimate_policy(config, build_policy(config.policy), device, autocast_cache=autocast_cache)


def default_policy(name: str) -> Policy:
    """A registered policy with the parameters of its conf/policy/<name>.yaml (the class defaults without one)."""
    path = CONF / "policy" / f"{name}.yaml"
    return build_policy(OmegaConf.load(path) if path.is_file() else {"name": name})


def estimate_all(
    config: Config, device: str = "cpu", plans: dict[str, Plan] | None = None, autocast_cache: bool = False
) -> dict[str, Estimate | str]:
    """Every registered policy: the configured one with its parameters, the others with their conf defaults
    (`plans` may give a policy's plan, e.g. the one a planner chose for `auto`).

    A policy that cannot run this model (e.g. policy.k > model.n_layer) maps to its one-line reason.
    """
    configured = build_policy(config.policy)
    out: dict[str, Estimate | str] = {}
    for name in POLICIES:
        try:
            policy = configured if name == configured.cfg.name else default_policy(name)
            out[name] = estimate_policy(config, policy, device, (plans or {}).get(name), autocast_cache)
        except PolicyError as e:
            out[name] = str(e)
    return out


def planner_plan(config: Config) -> tuple[Plan | None, str]:
    """policy=auto: the per-block plan trainer/planner.py would choose at fit start (it profiles the real model on
    a random micro-batch) and its explanation; (None, why) when no planner is importable here. Its one-line
    PolicyError when nothing fits the budget propagates."""
    try:
        from trainer.planner import plan_for_config
    except ImportError as e:
        return None, f"no planner to ask ({e}); auto is estimated with its pre-choice plan (every block full)"
    return plan_for_config(config)


# ----------------------------------------------------------------------------------------------------
# The command line.
# ----------------------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'40GB' (10⁹ bytes), '40GiB' (2³⁰), '40000MiB', '1.5TB', '123456' (bytes); case-insensitive."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"--budget {text!r}: write a positive size such as 40GB, 40GiB or 40000MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _mib(n: float) -> str:
    return f"{n / MIB:,.1f}"


def _flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} FLOP"


def _size(n: int) -> str:
    """A budget as the user likely wrote it: GB (10⁹) from 1 GB up, MiB below."""
    return f"{n / 1e9:,.4g} GB" if n >= 10**9 else f"{n / MIB:,.1f} MiB"


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def render(config: Config, est: Estimate, table: dict[str, Estimate | str], budget: int | None) -> str:
    """The report: the configured policy's breakdown, its FLOPs, every policy side by side, and the verdict."""
    sh, _ = shapes_of(config, est.device, est.autocast_cache)
    none = table.get("none")
    base = none.flops if isinstance(none, Estimate) else est.fwd_flops + est.bwd_flops
    lines = [
        f"model {config.model.name}: {sh.n_layer} layers, n_embd {sh.n_embd}, {sh.n_head} heads, vocab {sh.vocab}, "
        f"{parameter_count(sh):,} parameters; attention={sh.attention} (runs as: {sh.attn_kernel}), "
        f"dropout={sh.dropout}, bias={sh.bias}",
        f"micro-batch {config.batch_size} × {config.seq_len} tokens, accum={config.accum}, "
        f"precision={config.precision}, device={est.device} (--device cpu|cuda; default from trainer.accelerator)",
    ]
    lines += [f"assumption: {n}" for n in dict.fromkeys(est.notes)]
    c = est.components
    per = est.per_block
    per_text = f"{len(per)} × {_mib(per[0])}" if len(set(per)) == 1 else " ".join(_mib(x) for x in per)
    rows = [
        (f"parameters ({sh.param})", c["parameters"], ""),
        ("buffers (causal masks, bool)", c["buffers"], ""),
        ("AdamW state (exp_avg, exp_avg_sq)", c["optimizer_state"], ""),
        (f"gradients ({sh.param})", c["gradients"], "(last step's in forward; made one by one in backward)"),
        ("activation peak of one micro-batch", est.activation_bytes, f"at {est.peak_at}; of which:"),
        ("  activations (kept, or in use in forward)", c["activations"], ""),
        ("  recompute transient", c["recompute_transient"], ""),
        ("  gradients in flight", c["backward_working_set"], ""),
        ("  logits / loss", c["logits_loss"], ""),
        ("  autocast weight copies", c["autocast_weight_copies"], ""),
        ("  tied wte/lm_head grad buffer", c["tied_grad_buffer"], "(lm_head's part; wte's .grad: the sum, made last)"),
        ("AdamW.step() temporaries", c["optimizer_step_transient"], "(after backward, beside every gradient)"),
        (
            "total (peak of the whole step)",
            est.peak_bytes,
            f"at {est.step_peak_at} (the state above, {_mib(c['step_peak_gradients'])} of gradients, "
            f"{_mib(c['step_peak_in_flight'])} in flight)",
        ),
    ]
    lines += ["", f"memory, policy={est.policy} (plan {est.plan}), MiB:"]
    lines += [f"  {label:<44}{_mib(v):>12}  {note}".rstrip() for label, v, note in rows]
    lines.append(
        f"  kept from forward to backward: {_mib(est.kept_bytes)} MiB; per block {per_text} MiB; "
        f"largest recompute transient {_mib(est.recompute_transient_bytes)} MiB"
        + (f"; {_mib(est.host_bytes)} MiB offloaded to pinned host memory" if est.host_bytes else "")
    )
    lines += [
        "",
        f"compute per optimizer step ({est.micro_batches} micro-batch{'es' if est.micro_batches > 1 else ''}): "
        f"forward {_flops(est.fwd_flops)}, backward {_flops(est.bwd_flops)}, recompute {_flops(est.recompute_flops)} "
        f"(+{100 * est.recompute_flops / max(1, est.fwd_flops + est.bwd_flops):.1f} %) "
        f"= {est.flops / base:.3f}× the FLOPs of `none`",
        "",
    ]
    fits_head = f"fits {_size(budget)}?" if budget is not None else "fits? (no --budget)"
    lines += [
        f"| policy | plan | activation peak MiB | total MiB | FLOPs × none | {fits_head} |",
        "|---|---|---:|---:|---:|---|",
    ]
    for name, e in table.items():
        star = " *" if name == est.policy else ""
        if isinstance(e, str):
            lines.append(f"| {name}{star} | n/a: {e} | | | | |")
            continue
        fits = "—" if budget is None else ("yes" if e.fits(budget) else "no")
        lines.append(
            f"| {name}{star} | {_short(e.plan)} | {_mib(e.activation_bytes)} | {_mib(e.peak_bytes)} | "
            f"{e.flops / base:.3f} | {fits} |"
        )
    lines.append("(* the configured policy; the others with their conf/policy defaults)")
    if budget is not None:
        ok = est.fits(budget)
        fitting = [n for n, e in table.items() if isinstance(e, Estimate) and e.fits(budget)]
        lines.append(
            f"policy={est.policy} {'fits' if ok else 'does not fit'} in {_size(budget)} "
            f"({budget / 2**30:,.2f} GiB): it needs {est.peak_bytes / 2**30:,.2f} GiB ({_mib(est.peak_bytes)} MiB)"
            + ("" if ok else f"; policies that fit: {', '.join(fitting) or 'none'}")
        )
    lines.append(
        "not modelled: allocator rounding and fragmentation, the CUDA context and cuBLAS workspace, torch.compile, "
        "scratch buffers inside kernels"
    )
    return "\n".join(lines)


def compose_config(overrides: Sequence[str]) -> Config:
    """train.py's config from the same overrides, validated (raises Hydra, Config or Policy errors)."""
    from hydra import compose, initialize_config_dir

    from trainer.schema import register_configs, validate

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return validate(cfg)


def _to_json(config: Config, est: Estimate, table: dict[str, Estimate | str], budget: int | None) -> dict[str, Any]:
    sh, _ = shapes_of(config, est.device, est.autocast_cache)
    return {
        "config": {
            "model": config.model.name,
            **{k: v for k, v in asdict(sh).items() if k != "device"},
            "attention_kernel": sh.attn_kernel,
            "parameters": parameter_count(sh),
            "accum": config.accum,
        },
        "device": est.device,
        "assumptions": list(dict.fromkeys(est.notes)),
        "budget_bytes": budget,
        "policy": est.policy,
        "fits": est.fits(budget),
        "estimate": est.to_json(),
        "all_policies": {
            k: (v.to_json() | {"fits": v.fits(budget)} if isinstance(v, Estimate) else {"error": v})
            for k, v in table.items()
        },
    }


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line and exit 2, like every other user error here
        print(f"error: {message} (see python -m trainer.estimate --help)", file=sys.stderr)
        raise SystemExit(2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(
        prog="python -m trainer.estimate",
        description="Memory and FLOPs of a training configuration under every activation policy; no data, no GPU.",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py (model=gpt2 policy=full ...)")
    parser.add_argument("--budget", help="device memory to fit in: 40GB (10⁹ bytes), 40GiB, 40000MiB")
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="also write the estimate here as JSON")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if trainer.accelerator=gpu, else cpu")
    parser.add_argument(
        "--autocast-cache",
        action="store_true",
        help="model torch.autocast with its weight cache on (a bare loop's default); train.py runs it off",
    )
    args = parser.parse_intermixed_args(argv)  # options may come before, between or after the overrides

    from trainer.schema import describe_user_error

    try:
        budget = None if args.budget is None else parse_bytes(args.budget)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        config = compose_config(args.overrides)
        device = args.device or ("cuda" if config.trainer.accelerator in ("gpu", "cuda") else "cpu")
        if config.precision == "16-mixed" and device != "cuda":
            raise ConfigError("precision=16-mixed needs a CUDA GPU; estimate it with --device cuda")
        policy = build_policy(config.policy)
        plans, preface = {}, ""
        if policy.cfg.name == "auto":
            with _quiet_policy_notices():
                policy.check(config.model.n_layer, config.model.attention)  # a missing budget: one line, exit 2
            plan, preface = planner_plan(config)
            plans = {"auto": plan} if plan is not None else {}
        cache = args.autocast_cache
        est = estimate_policy(config, policy, device, plans.get(policy.cfg.name), cache)  # a bad policy fails here
        table = estimate_all(config, device, plans, cache)
    except Exception as e:
        line = describe_user_error(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2
    if preface:
        print(preface.rstrip() + "\n")
    print(render(config, est, table, budget))
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_to_json(config, est, table, budget), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
