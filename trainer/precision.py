"""Precision that fits the hardware, and the precision plugin Lightning runs it with.

`precision=auto` (the default) is `bf16-mixed` where bf16 is native — a CUDA device that supports it, or a CPU with
AVX512-BF16 or AMX, as torch reports them — and `32-true` elsewhere. On a CPU without native bf16, autocast emulates
every bf16 matmul: the default tiny GPT's step measured 17× slower in bf16-mixed than in 32-true on a 2-core AMD
EPYC (AVX2 only), while on an Intel Xeon with AVX512-BF16 bf16 ran faster than fp32. An explicit bf16 precision on
such a CPU still runs, with one warning line.

`plugin(precision, device_type)` is the object Lightning's Trainer builds for the same string, so a bare step, the
planner's profile and the estimator run the forward in exactly the context `training_step` runs in
(`MixedPrecision(...).forward_context()` is autocast with its weight cache off; `HalfPrecision` for bf16-true sets
the default dtype during the forward and converts the module).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "bf16-mixed", "bf16-true", "32-true", "16-mixed")
EMULATED_BF16_SLOWDOWN = (
    "about 17× slower than 32-true (bf16-mixed, the default tiny GPT, measured on a 2-core AMD EPYC with AVX2 only)"
)


def cpu_bf16_native() -> tuple[bool, str]:
    """Whether this CPU runs bf16 matmuls natively, and what torch says about it."""
    avx512_bf16 = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    capability = torch.backends.cpu.get_cpu_capability()
    if avx512_bf16 or amx:
        what = " and ".join(n for n, ok in (("AVX512-BF16", avx512_bf16), ("AMX", amx)) if ok)
        return True, f"this CPU has {what} (torch: {capability})"
    return False, f"this CPU has no AVX512-BF16 or AMX (torch: {capability}), so bf16 autocast is emulated"


def bf16_native(device_type: str) -> tuple[bool, str]:
    if device_type == "cuda":
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported():
            return True, f"{name} supports bf16"
        return False, f"{name} has no bf16"
    return cpu_bf16_native()


def resolve(requested: str, device_type: str) -> tuple[str, str]:
    """The precision to train in and one line saying why. `requested` other than auto is kept as it is."""
    native, why = bf16_native(device_type)
    if requested != "auto":
        return requested, f"precision={requested} (as configured)"
    if native:
        return "bf16-mixed", f"precision=auto → bf16-mixed: {why}; precision=32-true forces fp32"
    return "32-true", f"precision=auto → 32-true: {why}; precision=bf16-mixed forces bf16, {EMULATED_BF16_SLOWDOWN}"


def emulation_warning(precision: str, device_type: str) -> str | None:
    """The warning for an explicit bf16 precision on a CPU that emulates it, or None."""
    if device_type != "cpu" or not precision.startswith("bf16"):
        return None
    native, why = cpu_bf16_native()
    if native:
        return None
    return (
        f"precision={precision} on this CPU: {why}; expect steps {EMULATED_BF16_SLOWDOWN}; precision=auto picks 32-true"
    )


def plugin(precision: str, device_type: str) -> Any:
    """Lightning's precision plugin for `precision` on this device type, as the Trainer builds it."""
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    if precision in ("bf16-mixed", "16-mixed"):
        return MixedPrecision(precision, device="cuda" if device_type == "cuda" else "cpu")  # type: ignore[arg-type]
    if precision == "bf16-true":
        return HalfPrecision(precision)
    if precision == "32-true":
        return Precision()
    raise ValueError(f"precision={precision!r} has no plugin; resolve `auto` first")


def param_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16-true" else torch.float32


def fsdp2_param_dtype(precision: str, trainer: Any) -> torch.dtype | None:
    """The dtype FSDP2's MixedPrecisionPolicy all-gathers and computes in (bf16), when the run trains under it:
    precision=bf16-mixed (settled) on trainer.strategy=fsdp2 with trainer.mixed_precision=fsdp2. None otherwise
    (autocast, or no mixed precision). `trainer`: the TrainerConfig."""
    if trainer.strategy == "fsdp2" and trainer.mixed_precision == "fsdp2" and precision == "bf16-mixed":
        return torch.bfloat16
    return None


def mp_policy(param: torch.dtype | None) -> Any:
    """FSDP2's MixedPrecisionPolicy for `param` (torchtitan's: fp32 gradient reduction), or None for FSDP2's
    default (parameters all-gathered and used in their own dtype)."""
    if param is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=torch.float32)


def lightning_precision(precision: str, trainer: Any) -> str:
    """The precision string Lightning's Trainer (and a bare step's plugin) runs with: 32-true (no autocast) where
    FSDP2's MixedPrecisionPolicy does the casting, else `precision` itself."""
    return "32-true" if fsdp2_param_dtype(precision, trainer) is not None else precision


def describe(precision: str, trainer: Any) -> str:
    """`precision` as a run's start line and the estimator's header name it: FSDP2's policy said where it applies."""
    if fsdp2_param_dtype(precision, trainer) is not None:
        return f"{precision} (FSDP2 MixedPrecisionPolicy: bf16 params and all-gathers, fp32 reduce-scatter)"
    return precision


def refuse_under_fsdp2(precision: str, trainer: Any) -> str | None:
    """The one line for a precision FSDP2's mixed-precision policy cannot run, or None. `trainer`: the
    TrainerConfig (its strategy and mixed_precision)."""
    if trainer.strategy == "fsdp2" and trainer.mixed_precision == "fsdp2" and precision == "16-mixed":
        return (
            "precision=16-mixed under trainer=fsdp2: FSDP2's mixed-precision policy here trains bf16, as torchtitan "
            "does (fp16 needs a gradient scaler); use precision=bf16-mixed, or trainer.mixed_precision=autocast "
            "for fp16 autocast over fp32 shards"
        )
    return None
