"""What the benchmarks share: the pages they write, the line every generated header starts with (where and how a
table was made), and their command lines' common options, publishing and error ending."""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from trainer.core.schema import describe_user_error
from trainer.formatting import add_page_arguments, replace_block
from trainer.measure.time.calibration import cpu_name
from trainer.precision import cpu_bf16_native, resolve

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
BENCHMARKS_PAGE = DOCS / "benchmarks.md"
STEP_TIME_PAGE = DOCS / "step-time.md"


class BenchError(ValueError):
    """A request this machine or shape cannot run; the message is one line."""


class Block(NamedTuple):
    """A table's place on a docs page: between `<!-- name:start -->` and `<!-- name:end -->`, under `heading` where
    the page has no such markers yet; on `page`, or the one --page names (None)."""

    name: str
    heading: str
    page: Path | None = None

    @property
    def start(self) -> str:
        return f"<!-- {self.name}:start -->"

    @property
    def end(self) -> str:
        return f"<!-- {self.name}:end -->"


def parser(
    prog: str,
    doc: str | None,
    overrides: str | None = None,
    page: Path | None = None,
    blocks: Sequence[Block] = (),
    device: bool = False,
    threads: bool = False,
    cached_speed: bool = False,
) -> argparse.ArgumentParser:
    """A benchmark's command line: its description (the module docstring's first line), the Hydra overrides (with
    `overrides` saying their default), --write-docs and --page (with `page`), and the options the measuring ones
    share."""
    ap = argparse.ArgumentParser(prog=prog, description=(doc or "").splitlines()[0])
    if overrides is not None:
        ap.add_argument("overrides", nargs="*", help=f"Hydra overrides, as for train.py{overrides}")
    if device:
        ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the steps run (default cpu)")
    if threads:  # use_device sets them
        ap.add_argument("--threads", type=at_least(1), help="torch CPU threads (default 1 on CPU)")
    if cached_speed:
        # The roofline's CPU is calibrated beside the measured steps by default: a shared machine's speed drifts. The
        # cached one (from the last calibration here) is for a quick look and for tests; the header says which.
        ap.add_argument(
            "--cached-speed",
            action="store_true",
            help="the roofline from this CPU's cached calibration, not one measured now beside the steps",
        )
    if page is not None:
        add_page_arguments(ap, page, f"the {', '.join(b.name for b in blocks)} block{'s' * (len(blocks) > 1)}")
    return ap


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer ≥ `low`."""

    def count(text: str) -> int:
        if int(text) < low:
            raise argparse.ArgumentTypeError(f"{text}: give at least {low}")
        return int(text)

    return count


def use_device(device: str, threads: int | None) -> None:
    """Refuse --device cuda where torch sees no GPU; set torch's CPU threads (one on CPU unless `threads` says: on 2
    cores shared with other work, a second thread's spin-waits made a tiny step 2-5x slower and far noisier)."""
    if device == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise BenchError(
            f"--device cuda: no CUDA device is visible to torch {torch.__version__} ({build}); use --device cpu"
        )
    if threads or device == "cpu":
        torch.set_num_threads(threads or 1)


def publish(printed: str, args: argparse.Namespace, blocks: dict[Block, str]) -> int:
    """A benchmark's ending: print its text, and with --write-docs put each block's text (unless empty) between its
    markers. Returns 0."""
    print(printed)
    if args.write_docs:
        for b, text in blocks.items():
            if text:
                replace_block(b.page or args.page, b.start, b.end, text, b.heading)
        print(f"\nwrote {', '.join(sorted({str(b.page or args.page) for b in blocks}))}", file=sys.stderr)
    return 0


def command(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """A benchmark's main, ended as every one ends a failure: a mistake in its input (a config error, or a BenchError
    its own checks raise) as one `error:` line on stderr and exit status 2; anything else (a bug: a ValueError from
    deep inside included) raised again, with its traceback (trainer.core.schema.user_error_status is the tools' same
    ending)."""

    @functools.wraps(main)
    def ended(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except Exception as e:
            line = describe_user_error(e)
            if line is None and not isinstance(e, BenchError):
                raise
            print(f"error: {line or e}", file=sys.stderr)
            return 2

    return ended


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
    parts = [env["date"], f"torch {env['torch']}"]
    if env["device"] == "cuda":
        parts.append(f"{env['gpu']} (bf16: {'yes' if env['gpu_bf16'] else 'no'})")
    parts += [f"CPU {env['cpu']} ({bf16})", threads_text(env["threads"])]
    req, used = env["precision_requested"], env["precision"]
    parts.append(f"precision={req} → {used}" if req != used else f"precision={used}")
    return ", ".join(parts)


def estimator(args: Sequence[str]) -> float:
    """`python -m trainer.estimate ARGS` in a fresh interpreter: its wall-clock seconds (a failure ends the run)."""
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "trainer.estimate", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: python -m trainer.estimate {' '.join(args)} failed: {r.stderr.strip()[-300:]}")
    return time.perf_counter() - start


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def threads_text(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def joined(items: Sequence[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    items = list(items)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}" if items else ""


def noisy(ms: float, spread: float, fmt: str = ",.0f") -> str:
    """A median step time and its noise, as every table prints it: '412 ±5%'."""
    return f"{ms:{fmt}} ±{100 * spread:.0f}%"
