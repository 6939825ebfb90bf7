"""Text the CLIs, the run and the callbacks print: an exception as one line, bytes as MiB, rows as a markdown table.

(models/ imports nothing from trainer/, so models/hf.py keeps a private copy of `one_line`.)"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from pathlib import Path

from trainer import CONF

MIB = 2**20  # every figure the project prints or logs in MiB divides by this


def mib(n: float) -> str:
    """Bytes as MiB with enough digits to tell small plans apart."""
    v = n / MIB
    return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"


def one_line(e: BaseException, limit: int = 400) -> str:
    """An exception's text on one line (whitespace collapsed, its type's name if it has none), cut at `limit`."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def markdown_cell(value: object) -> str:
    """A value as one table cell: a "|" escaped, line breaks made spaces."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: Sequence[str] = ()) -> str:
    """A markdown table: `align` has one "l" or "r" per column (left where it says nothing more)."""

    def line(cells: Iterable[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    marks = ["---:" if i < len(align) and align[i] == "r" else "---" for i in range(len(header))]
    body = [line(markdown_cell(c) for c in row) for row in rows]
    return "\n".join([line(markdown_cell(h) for h in header), line(marks), *body])


def flops_text(n: float) -> str:
    """A FLOP count in the largest unit under it: 32.36 GFLOP."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} FLOP"


# Docs pages: a command that makes a table writes it between its markers on a page, the rest untouched.


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


def add_page_arguments(ap: argparse.ArgumentParser, page: Path, blocks: str) -> None:
    """--write-docs (rewrite `blocks`, the marked blocks this benchmark writes, on --page) and --page, with their
    former names --write-readme and --readme: every benchmark that writes a docs table takes the same two flags."""
    ap.add_argument(
        "--write-docs",
        "--write-readme",
        dest="write_docs",
        action="store_true",
        help=f"rewrite {blocks} of --page (--write-readme: the same, its former name)",
    )
    ap.add_argument(
        "--page",
        "--readme",
        dest="page",
        type=Path,
        default=page,
        help=f"the docs page that --write-docs rewrites (default: {page.relative_to(CONF.parent)}; --readme: the same)",
    )


def budget_size(n: int) -> str:
    """A budget as the user likely wrote it: GB (10⁹) from 1 GB up, MiB below."""
    return f"{n / 1e9:,.4g} GB" if n >= 10**9 else f"{n / MIB:,.1f} MiB"
