"""One runner over the benchmarks' tables: `python -m bench <table> [--write-docs] [its own options]`.

    python -m bench                         # the tables, what each measures and the page it writes
    python -m bench policies --write-docs   # one table, measured now, written between its markers on its page
    python -m bench planner --help          # a table's own options

Each table is a module of bench/ with a `main(argv)`; this registry is the one list of them (the docs name a table by
its key here). The compatibility sweep of Hugging Face families is a tool, not a benchmark: `python -m
trainer.families`; so are docs/tensorboard.md's pictures: `python -m trainer.report.tensorboard`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import NamedTuple


class Table(NamedTuple):
    module: str
    page: str
    what: str


P = "docs/benchmarks.md"
TABLES = {
    "policies": Table(
        "bench.policies",
        P,
        "every policy and loss head: step time, memory and FLOPs, measured beside the estimate; each plan",
    ),
    "planner": Table("bench.planner", P, "policy=auto across budgets beside the uniform policies"),
    "compiled": Table("bench.compiled", P, "compiled against eager per policy; the budget partitioner"),
    "step-time": Table("bench.step_time_table", "docs/step-time.md", "predicted step per policy on catalogue GPUs"),
    "published": Table("bench.published", "README.md", "the published GPU record beside the estimate"),
    "data": Table(
        "bench.data", "docs/data.md", "first step and peak memory: streamed, prepared and nanoGPT-style corpora"
    ),
    "fit-time": Table("bench.fit_time", "(prints only)", "what --fit costs beside one estimate"),
    "calibrate": Table(
        "bench.calibrate", "conf/gpu/<the device>.yaml", "this device's matmul, attention, copy and launch rates"
    ),
}


def listing() -> str:
    width = max(map(len, TABLES))
    rows = [f"  {name:<{width}}  {t.what} → {t.page}" for name, t in TABLES.items()]
    return "usage: python -m bench <table> [--write-docs] [options]\n\ntables:\n" + "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(listing())
        return 0
    if args[0] not in TABLES:
        print(
            f"error: no table {args[0]!r}; choose one of {', '.join(TABLES)} (python -m bench lists them)",
            file=sys.stderr,
        )
        return 2
    return int(importlib.import_module(TABLES[args[0]].module).main(args[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
