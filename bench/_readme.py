"""Helpers the benchmarks share: rewrite one marked block of the README, and name the CPU."""

from __future__ import annotations

import platform
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def replace_block(path: Path, start: str, end: str, block: str, heading: str) -> None:
    """Put `block` between the `start` and `end` markers of `path`, leaving everything else as it was.

    If the markers are missing (or out of order), a new section `heading` holding them is appended at the end.
    """
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    body = f"{start}\n{block}\n{end}"
    if start in text and end in text and text.index(start) < text.index(end):
        pre, rest = text.split(start, 1)
        _, post = rest.split(end, 1)
        text = pre + body + post
    else:
        text = text.rstrip("\n") + f"\n\n{heading}\n\n" + body + "\n"
    path.write_text(text)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
