"""Scaled dot-product attention as a CUDA GPU runs it, for an estimate translated from the CPU (`--device cuda` on a
torch without CUDA): the kernel torch's SDPA dispatch picks on the GPU, run on the estimate's fake CPU tensors
through that kernel's own aten op, whose meta kernel gives CUDA's outputs. So its output, what its backward keeps
(the log-sum-exp, the RNG state under dropout), its FLOPs (torch's formulas for the CUDA ops) and its op name, which
the SAC save lists match (`aten._scaled_dot_product_flash_attention` rather than the CPU's `..._for_cpu`), are CUDA's.

    kernel = cuda_sdpa_kernel(q, k, v, is_causal=True, enable_gqa=True)   # "flash" for bf16 inputs
    out = cuda_sdpa(q, k, v, is_causal=True, enable_gqa=True)            # runs it on q, k, v (fake or real)

The choice is `select_sdp_backend` (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) in torch's default
priority order, flash, memory-efficient, math (`torch._C._get_sdp_priority_order()`), on an NVIDIA GPU of compute
capability 8.0 or newer (every NVIDIA GPU of the catalogue), honouring `torch.backends.cuda.enable_*_sdp`:

* flash: fp16/bf16, no attn_mask, 4-D inputs with one head size ≤ 256 (padded to a multiple of 8 around the
  kernel, as the dispatch does), causal only with as many keys as queries, as many key/value heads as query heads
  or, with enable_gqa, key/value heads dividing them;
* memory-efficient: fp16/bf16/fp32, 4-D, head sizes a multiple of the GEMM alignment (8 elements for 16-bit, 4 for
  fp32), a mask allowed (a boolean one made additive), as many key/value heads as query heads (torch 2.13's kernel
  has no GQA);
* math otherwise: the composite `_scaled_dot_product_attention_math`: 16-bit inputs upcast to fp32 (unless
  `torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)`), key/value heads repeated for GQA, the T×T
  probabilities kept, and under dropout CUDA's fused dropout (its 1-byte mask), where the CPU's composite would draw
  an unfused mask in fp32.

Known limits: cuDNN attention, which torch puts first on sm90 and sm100 with cuDNN newer than 9.15
(`check_prefer_cudnn_attention`), is not chosen; it keeps the same output and log-sum-exp bytes as flash and costs
the same FLOPs, and the shipped save lists name both. The sm86/sm89/sm120 training rule for head sizes 193–224
(flash refused) and the memory-efficient kernel's storage-offset alignment are not modelled.

Near tool: torch's own dispatch (`torch._fused_sdp_choice`) answers for the device its tensors are on, so on fake
CPU tensors it answers for the CPU; this module answers for a CUDA GPU on any device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_HALF = (torch.float16, torch.bfloat16)
KERNELS = ("flash", "efficient", "math")


def cuda_sdpa_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> str:
    """Which of flash, efficient or math a CUDA GPU (sm80+) runs for these inputs, as torch's dispatch decides."""
    four_d = query.dim() == key.dim() == value.dim() == 4
    heads = (query.shape[-3], key.shape[-3], value.shape[-3]) if four_d else (0, 0, 0)
    sizes = (query.shape[-1], key.shape[-1], value.shape[-1])
    same_heads = heads[0] == heads[1] == heads[2]
    strided = all(t.stride(-1) == 1 for t in (query, key, value))
    nonempty = query.shape[-2] > 0 and key.shape[-2] > 0
    dtype = query.dtype
    backends = torch.backends.cuda
    if (
        backends.flash_sdp_enabled()
        and four_d
        and strided
        and nonempty
        and dtype in _HALF
        and attn_mask is None
        and sizes[0] == sizes[1] == sizes[2] <= 256
        and not (is_causal and query.shape[-2] != key.shape[-2])
        and (same_heads or (enable_gqa and heads[1] == heads[2] and heads[0] % heads[1] == 0))
    ):
        return "flash"
    align = 8 if dtype in _HALF else 4
    if (
        backends.mem_efficient_sdp_enabled()
        and four_d
        and strided
        and nonempty
        and dtype in (*_HALF, torch.float32)
        and all(d % align == 0 for d in sizes)
        and same_heads
    ):
        return "efficient"
    if backends.math_sdp_enabled():
        return "math"
    raise RuntimeError(
        "scaled_dot_product_attention: no CUDA kernel is enabled for these inputs "
        "(torch.backends.cuda.enable_math_sdp(False) and neither flash nor memory-efficient attention applies)"
    )


def cuda_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, run as a CUDA GPU runs it (aten/src/ATen/native/transformers/attention.cpp,
    `scaled_dot_product_attention`): the chosen kernel's op with the dispatch's own pre- and post-processing.

    Under autocast, as CUDA's autocast runs SDPA (its lower-precision list): floating inputs cast to autocast's
    dtype, and the kernel run with autocast off (the math path's upcast matmuls stay fp32). The fake tensors' device
    stands in for CUDA: the estimate's autocast is the CPU's."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (t.to(dtype) if t.is_floating_point() else t for t in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(dtype)
        with torch.autocast(device, enabled=False):
            return _run(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return _run(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _run(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    kernel = cuda_sdpa_kernel(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # convert_boolean_attn_mask: additive, query's dtype
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(attn_mask.logical_not(), -math.inf)
    if kernel == "flash":
        size = query.shape[-1]
        scale = 1 / math.sqrt(size) if scale is None else scale  # the unpadded size's (calculate_scale)
        pad = -size % 8  # pad_last_dim<8>: the kernel reads head sizes in multiples of 8
        q, k, v = (F.pad(t, (0, pad)) if pad else t for t in (query, key, value))
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        return out[..., :size] if pad else out
    if kernel == "efficient":
        if attn_mask is not None:  # preprocess_mask: an unaligned bias padded to 8 and sliced back, then expanded
            aligned = attn_mask.stride(-1) == 1 and all(s % 8 == 0 for s in attn_mask.stride()[:-1])
            if not aligned:
                last = attn_mask.shape[-1]
                attn_mask = F.pad(attn_mask, (0, 8 - last % 8))[..., :last]
            attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        logsumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, logsumexp, dropout_p, is_causal, scale=scale
        )[0]
    return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """`_scaled_dot_product_attention_math` as CUDA runs it. Without dropout, torch's own composite op; with dropout,
    the same steps written out, because inside the composite `at::dropout` takes CUDA's fused kernel only for CUDA
    tensors (on the fake CPU tensors it would keep an fp32 mask where the GPU keeps a 1-byte one)."""
    if dropout_p == 0.0:
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa
        )[0]
    origin = query.dtype
    if not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        query, key, value = (t.float() if t.dtype in _HALF else t for t in (query, key, value))
    negative = scale is not None and scale < 0
    factor = math.sqrt(abs(scale) if scale is not None else 1 / math.sqrt(query.shape[-1]))
    query = query * (-factor if negative else factor)
    if is_causal:
        causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        attn_mask = torch.zeros_like(causal, dtype=query.dtype).masked_fill_(causal.logical_not(), -math.inf)
    if enable_gqa and query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(group, -3), value.repeat_interleave(group, -3)
    attn = torch.matmul(query, key.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn.add_(attn_mask)
    attn = torch.ops.aten._safe_softmax(attn, -1)
    attn = torch.native_dropout(attn, dropout_p, True)[0]
    return torch.matmul(attn, value).to(origin)
