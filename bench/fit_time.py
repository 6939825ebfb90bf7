"""What `--fit` costs beside one estimate: the estimator's command without and with `--fit`, run one after the other
in fresh interpreters on the same machine, and the ratio of their wall-clock times (with the world sizes --fit
estimated: it adds FSDP2 estimates only where one device does not hold a cell).

    python -m bench.fit_time                                   # llama3-8b at 8 × 4096 tokens
    python -m bench.fit_time model=llama3-1b seq_len=2048 batch_size=4
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.common import cpu_name, estimator, parser

DEFAULT = ["model=llama3-8b", "seq_len=4096", "batch_size=8"]


def main(argv: Sequence[str] | None = None) -> int:
    args = parser("python -m bench.fit_time", __doc__, f" (default: {' '.join(DEFAULT)})").parse_args(argv)
    overrides = args.overrides or DEFAULT
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fit.json"
        one = estimator([*overrides, "--device", "cuda"])
        fit = estimator([*overrides, "--fit", "--json", str(out)])
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
