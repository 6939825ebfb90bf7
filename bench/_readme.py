"""Helpers the benchmarks share: rewrite one marked block of a docs page, name the CPU, and say in one line where
and how a table was made (every generated header carries it)."""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path
from typing import Any

import torch

from trainer.core.schema import describe_user_error
from trainer.formatting import add_page_arguments, replace_block
from trainer.measure.time.calibration import cpu_name
from trainer.precision import cpu_bf16_native, resolve

__all__ = [
    "add_page_arguments",
    "BENCHMARKS_PAGE",
    "CACHED_SPEED_HELP",
    "DOCS",
    "ROOT",
    "STEP_TIME_PAGE",
    "cpu_name",
    "environment",
    "environment_text",
    "replace_block",
]

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BENCHMARKS_PAGE = DOCS / "benchmarks.md"  # the measured tables, each between its markers
STEP_TIME_PAGE = DOCS / "step-time.md"  # the estimator's predicted step per policy (bench.step_time_table)
# A roofline's CPU is calibrated beside the measured steps by default: a shared machine's speed drifts, and the
# calibration costs tens of seconds where bf16 is emulated. The cached one (from the last calibration here) is for a
# quick look and for tests, whose figures do not depend on it; the header says which it was.
CACHED_SPEED_HELP = "the roofline from this CPU's cached calibration, not one measured now beside the steps"


def publish(args: argparse.Namespace, block: str, start: str, end: str, heading: str) -> int:
    """A single-block benchmark's ending: print the block, and with --write-docs put it on --page. Returns 0."""
    print(block)
    if args.write_docs:
        replace_block(args.page, start, end, block, heading)
        print(f"\nwrote {args.page}", file=sys.stderr)
    return 0


def environment(device_type: str, requested: str) -> dict[str, Any]:
    """Where a table is made and the precision it runs in: `requested` (a config's `precision`, `auto` included)
    settled as a run settles it (`trainer.precision.resolve`)."""
    used, why = resolve(requested, device_type)
    native, native_why = cpu_bf16_native()
    env: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "torch": torch.__version__,
        "device": device_type,
        "cpu": cpu_name(),
        "cpu_bf16_native": native,
        "cpu_bf16": native_why,
        "threads": torch.get_num_threads(),
        "precision_requested": requested,
        "precision": used,
        "precision_why": why,
    }
    if device_type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_bf16"] = torch.cuda.is_bf16_supported()
    return env


def environment_text(env: dict[str, Any]) -> str:
    """'2026-12-01, torch 2.13.0+cpu, AMD EPYC (no native bf16: AVX2), 1 thread, precision=auto → 32-true'."""
    bf16 = "native bf16" if env["cpu_bf16_native"] else "no native bf16: bf16 autocast is emulated"
    threads = env["threads"]
    parts = [env["date"], f"torch {env['torch']}"]
    if env["device"] == "cuda":
        parts.append(f"{env['gpu']} (bf16: {'yes' if env['gpu_bf16'] else 'no'})")
    parts += [f"CPU {env['cpu']} ({bf16})", f"{threads} thread{'s' if threads != 1 else ''}"]
    req, used = env["precision_requested"], env["precision"]
    parts.append(f"precision={req} → {used}" if req != used else f"precision={used}")
    return ", ".join(parts)


def error_status(e: BaseException) -> int:
    """A benchmark command's ending for a failure: a mistake in its input (a config error, or a ValueError its own
    checks raise) as one `error:` line on stderr and exit status 2; anything else raised again, with its traceback.
    trainer.core.schema.user_error_status is the tools' same ending without the ValueError."""
    line = describe_user_error(e)
    if line is None and not isinstance(e, ValueError):
        raise e
    print(f"error: {line or e}", file=sys.stderr)
    return 2
