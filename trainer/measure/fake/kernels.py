"""Fake-tensor rules for kernels whose fake output torch gets wrong, registered only for an estimate's fake run: a
CPU kernel's output, and a collective's wait that hands back its input.

`aten._grouped_mm` (the grouped matmul of Mixture-of-Experts layers: transformers' default `grouped_mm` experts run
`torch.nn.functional.grouped_mm`, one call per projection and two more in its backward) has a CPU kernel for
float32, bfloat16 and float16, but its meta kernel (torch/_meta_registrations.py, `_meta_grouped_mm_common`) is the
CUDA kernel's: it refuses anything but bfloat16, and pads the output's row stride to 16 bytes only on a CUDA build of
torch, while the CPU kernel always pads it. `grouped_mm_cpu_fake` makes the CPU kernel's output under fake tensors: the
same checks, dtype, shape, strides and storage, so the estimate allocates what the run allocates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_strides(name: str, mat: torch.Tensor) -> None:
    """The kernel's layout rule: row- or column-major in the last two dimensions, the leading stride 16-byte aligned."""
    align = 16 // mat.element_size()
    (s_row, s_col), (rows, cols) = mat.stride()[-2:], mat.shape[-2:]
    if s_row == 1 and s_col >= max(1, rows):
        lead = s_col
    elif s_col == 1 and s_row >= max(1, cols):
        lead = s_row
    else:
        raise RuntimeError(f"{name}: invalid strides/sizes, got {list(mat.stride())} for sizes {list(mat.shape)}")
    torch._check(lead % align == 0, lambda: f"{name}: strides should be multiple of 16 bytes")


def grouped_mm_cpu_fake(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The output `aten._grouped_mm` makes on CPU (ATen's create_grouped_gemm_output_tensor): shape from the layouts
    (2D×3D, 3D×2D: one row per row of the 2D operand; 2D×2D: one matrix per group; 3D×3D: a batched matmul), the
    last dimension's stride rounded up to 16 bytes, in mat_a's dtype. Other devices keep torch's own meta kernel."""
    if mat_a.device.type != "cpu":
        from torch._decomp import meta_table

        return meta_table[torch.ops.aten._grouped_mm.default](mat_a, mat_b, offs, bias, out_dtype)
    torch._check(
        mat_a.dtype in _GROUPED_MM_DTYPES,
        lambda: f"Expected mat_a to be Float32, BFloat16 or Float16 matrix, got {mat_a.dtype}",
    )
    torch._check(
        mat_b.dtype == mat_a.dtype,
        lambda: f"expected m1 and m2 to have the same dtype, but got: {mat_a.dtype} != {mat_b.dtype}",
    )
    torch._check(
        out_dtype is None or out_dtype == mat_a.dtype,
        lambda: "Grouped gemm output dtype must match `mat_a` dtype",
    )
    torch._check(bias is None, lambda: "Bias not supported yet")
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3), lambda: "Multiplicands must be 2D or 3D")
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if not (a_2d and b_2d):
        torch._check(mat_a.size(-1) == mat_b.size(-2), lambda: "contraction dimension of mat_a and mat_b must match")
    _check_strides("mat_a", mat_a)
    _check_strides("mat_b", mat_b)
    if a_2d or b_2d:
        torch._check(offs is not None, lambda: "Offsets tensor not provided, but is needed for 2D operands")
        assert offs is not None
        torch._check(offs.dim() == 1 and offs.dtype == torch.int32, lambda: "Offsets have to be int32")
    else:
        torch._check(offs is None, lambda: "Offsets tensor provided, but is not needed for 3D/3D multiplicands")
    if a_2d and b_2d:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]  # type: ignore[union-attr]
    elif a_2d:
        torch._check(offs.size(0) == mat_b.size(0), lambda: "matrix batch sizes have to match")  # type: ignore[union-attr]
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b_2d:
        torch._check(offs.size(0) == mat_a.size(0), lambda: "matrix batch sizes have to match")  # type: ignore[union-attr]
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        torch._check(mat_a.size(0) == mat_b.size(0), lambda: "batched dimension has to match")
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    align = 16 // mat_a.element_size()
    padded = (size[-1] + align - 1) // align * align
    stride = [padded, 1] if len(size) == 2 else [size[1] * padded, padded, 1]
    return torch.empty_strided(size, stride, dtype=mat_a.dtype, device=mat_a.device)


def wait_tensor_fake(tensor: torch.Tensor) -> torch.Tensor:
    """`_c10d_functional.wait_tensor` hands back the tensor it waited on (the collective's output, filled in place);
    torch's fake kernel makes a new one, so on fake tensors each collective a DTensor waits on (tensor parallelism's
    all-gathers and reduce-scatters) would be counted twice while both are alive."""
    return tensor


@contextlib.contextmanager
def cpu_kernel_rules() -> Iterator[None]:
    """The rules above, for fake tensors in this context only.

    Each rule is put in the operator's fake-impl holder, which FakeTensorMode consults before an op's meta kernel, and
    taken out on exit. `torch.library.register_fake` would also install a Meta kernel, and removing its library does
    not give `wait_tensor` back the Meta kernel it had: every later fake run of a collective (dynamo tracing a
    tensor-parallel step after the run's own estimate) would fail with an empty holder.
    """
    # Needed: torch's _grouped_mm meta kernel is CUDA's (bf16 only), so an fp32 MoE fails on fake tensors, not on CPU.
    from torch._library.simple_registry import singleton
    from torch._library.utils import Kernel

    rules = {"aten::_grouped_mm": grouped_mm_cpu_fake, "_c10d_functional::wait_tensor": wait_tensor_fake}
    holders = [singleton.find(name).fake_impl for name in rules]
    # torch keeps a holder's kernels in a list (newest last) from 2.8 on; 2.7 holds a single `kernel`
    saved = [None if hasattr(h, "kernels") else h.kernel for h in holders]
    for holder, fn in zip(holders, rules.values(), strict=True):
        if hasattr(holder, "kernels"):
            holder.kernels.append(Kernel(fn, __name__))
        else:
            holder.kernel = Kernel(fn, __name__)
    try:
        yield
    finally:
        for holder, old in zip(holders, saved, strict=True):
            if hasattr(holder, "kernels"):
                holder.kernels.pop()
            else:
                holder.kernel = old
