"""What `--fit` costs beside one estimate: the estimator's command without and with `--fit`, run one after the other
in fresh interpreters on the same machine, and the ratio of their wall-clock times.

    python -m bench.fit_time                                   # llama3-8b at 8 × 4096 tokens
    python -m bench.fit_time model=llama3-1b seq_len=2048 batch_size=4

`--fit` reuses the estimate's own session at world size 1 and adds FSDP2 estimates only where one device does not
hold a cell (world sizes 2 and 64, then those the bounds leave open), so its cost is a few estimates, not one per
world size. The world sizes it estimated are printed with the ratio.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench._readme import cpu_name

DEFAULT = ["model=llama3-8b", "seq_len=4096", "batch_size=8"]


def _timed(args: Sequence[str]) -> float:
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "trainer.estimate", *args], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"error: python -m trainer.estimate {' '.join(args)} failed: {r.stderr.strip()[-300:]}")
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fit_time", description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help=f"Hydra overrides (default: {' '.join(DEFAULT)})")
    args = ap.parse_args(argv)
    overrides = args.overrides or DEFAULT
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fit.json"
        one = _timed([*overrides, "--device", "cuda"])
        fit = _timed([*overrides, "--fit", "--json", str(out)])
        doc = json.loads(out.read_text())
    print(f"{' '.join(overrides)}, --device cuda, precision {doc['estimate']['precision']}, on {cpu_name()}")
    worlds = ", ".join(map(str, doc["fit_worlds_estimated"]))
    print(
        f"estimate alone {one:.1f} s; estimate with --fit {fit:.1f} s: {fit / one:.2f}× "
        f"({len(doc['fit'])} cells; world sizes estimated: {worlds})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
