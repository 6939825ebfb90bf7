"""Open a sweep in TensorBoard as a user does, photograph its tabs, and say what TensorBoard itself serves.

    python -m trainer.report.tensorboard                          # a tiny CPU sweep (policy=none,full) in a temp folder
    python -m trainer.report.tensorboard --sweep runs/sweeps/<stamp> --out docs    # a sweep of yours (made if missing)

Starts `tensorboard --logdir <sweep> --port <free port>`, reads its HTTP data API (the runs, the HParams experiment
and sessions, the Time Series tags, the Custom Scalars layout), opens the Time Series, HParams and Custom Scalars
tabs in headless Chromium and writes <out>/tensorboard_{timeseries,hparams,custom_scalars}.png. Prints what a
reader of the page gets first: the run names, the HParams columns TensorBoard ticks, the Time Series groups it
opens. tests/test_tensorboard.py runs the same on a tiny sweep (slow, skipped without Chromium).

Needs Chromium (Debian: `apt-get install -y chromium`). On a closed network Chromium refuses its own connections
unless its background services are off, hence the flags in CHROMIUM_FLAGS and a fresh profile every time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer import CONF

ROOT = CONF.parent  # the checkout: train.py and docs/
# The policy_sweep preset, shrunk (as tests/test_sweep.py runs it): policy none,full x micro 8x1,2x4 = 4 jobs of
# seconds each on 2 CPU cores. The shrinking keys stay out of the job folders' names (and so the run names).
SWEEP = ["experiment=policy_sweep", "policy=none,full", "micro=8x1,2x4"]
TINY = [
    "model=micro",
    "trainer=smoke",
    "seq_len=32",
    "trainer.enable_progress_bar=false",
    "trainer.enable_checkpointing=false",
    "trainer.max_steps=6",
    "trainer.val_every_n_steps=3",
    "measure.warmup_steps=1",
    "measure.activation_every_n_steps=2",
]
# file name → (URL hash, window size): the HParams table is wide (five hparams, then five metrics)
TABS = {
    "timeseries": ("timeseries", (1400, 900)),
    "hparams": ("hparams", (2400, 480)),
    "custom_scalars": ("custom_scalars", (1400, 900)),
}
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TICKED = 5  # TensorBoard's HParams table ticks its first five hparams and first five metrics


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def tiny_sweep(sweep: Path, *overrides: str, timeout: float = 600) -> Path:
    """`python train.py -m experiment=policy_sweep policy=none,full micro=8x1,2x4` with tiny shapes into `sweep`
    (job folders named by what varies: `0_micro=8x1,policy=none`); raises with the output's tail."""
    hidden = ",".join(["experiment", *(o.split("=", 1)[0] for o in TINY)])
    names = f"hydra.job.config.override_dirname.exclude_keys=[{hidden}]"
    args = [sys.executable, str(ROOT / "train.py"), "-m", *SWEEP, *TINY, names, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(
        [*args, f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if r.returncode != 0:
        raise RuntimeError(f"the sweep failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    return sweep


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class TensorBoard:
    """A `tensorboard` process serving `logdir` on localhost, and its HTTP data API."""

    logdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> None:
        exe = shutil.which("tensorboard", path=str(Path(sys.executable).parent)) or shutil.which("tensorboard")
        cmd = [exe] if exe else [sys.executable, "-m", "tensorboard.main"]
        self.proc = subprocess.Popen(
            [
                *cmd,
                "--logdir",
                str(self.logdir),
                "--port",
                str(self.port),
                "--host",
                "127.0.0.1",
                "--reload_interval",
                "0",
                "--load_fast",
                "false",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tensorboard exited with {self.proc.returncode}")
            try:
                if self.runs():  # the logdir has been read once (--reload_interval 0: exactly once)
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"tensorboard did not serve {self.logdir} within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def get(self, route: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + route, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    # --- what the tabs are drawn from ---------------------------------------------------------------------------
    def runs(self) -> list[str]:
        return list(self.get("/data/runs"))

    def hparams_experiment(self) -> dict[str, Any]:
        """The HParams columns as the dashboard asks for them (hparamInfos in TensorBoard's order)."""
        return dict(self.get("/data/plugin/hparams/experiment", {"experimentName": "", "hparamsLimit": 1000}))

    def session_groups(self) -> list[dict[str, Any]]:
        statuses = ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]
        body = {"experimentName": "", "allowedStatuses": statuses, "startIndex": 0, "sliceSize": 1000}
        return list(self.get("/data/plugin/hparams/session_groups", body).get("sessionGroups", []))

    def scalar_tags(self) -> dict[str, list[str]]:
        """run → its scalar tags, as the Time Series tab lists them."""
        tags = self.get("/data/plugin/timeseries/tags")
        return {run: sorted(t) for run, t in tags["scalars"]["runTagInfo"].items()}

    def custom_scalars_layout(self) -> dict[str, Any]:
        return dict(self.get("/data/plugin/custom_scalars/layout"))


@contextmanager
def serving(logdir: Path) -> Iterator[TensorBoard]:
    tb = TensorBoard(Path(logdir))
    try:
        tb.start()
        yield tb
    finally:
        tb.stop()


def ticked_hparams(experiment: dict[str, Any]) -> list[str]:
    """The hparam columns the HParams table shows without a click: `differs` ones first (a stable sort), first five
    (tf-hparams-query-pane's _computeHParams)."""
    infos = sorted(experiment.get("hparamInfos", []), key=lambda i: not i.get("differs", False))
    return [i.get("displayName") or i["name"] for i in infos[:TICKED]]


def ticked_metrics(experiment: dict[str, Any]) -> list[str]:
    infos = experiment.get("metricInfos", [])[:TICKED]
    return [i.get("displayName") or i["name"]["tag"] for i in infos]


def timeseries_groups(tags: list[str]) -> list[str]:
    """Time Series card groups in page order: each tag's first component, sorted (its groupCardIdWithMetdata; the
    page opens the first two). Plain string order matches TensorBoard's for tags without digits."""
    return sorted({t.split("/", 1)[0] for t in tags})


def screenshot(chromium: str, url: str, png: Path, size: tuple[int, int] = (1400, 900), budget_ms: int = 15000) -> Path:
    """One headless-Chromium screenshot of `url` after `budget_ms` of virtual time (the page's fetches finish)."""
    with tempfile.TemporaryDirectory(prefix="tb-chromium-") as profile:
        cmd = [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={size[0]},{size[1]}",
            f"--virtual-time-budget={budget_ms}",
            f"--screenshot={png}",
            url,
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if r.returncode != 0 or not png.is_file():
        raise RuntimeError(f"chromium failed ({r.returncode}): {r.stderr[-2000:]}")
    return png


def photograph(tb: TensorBoard, out: Path, chromium: str) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    # forceSVG (a TensorBoard feature flag): Time Series draws its charts as SVG in the page instead of on a worker's
    # offscreen canvas, which headless Chromium without a GPU photographs half-drawn now and then. Same charts.
    return {
        name: screenshot(chromium, f"{tb.url}/?forceSVG=true#{tab}", out / f"tensorboard_{name}.png", size)
        for name, (tab, size) in TABS.items()
    }


def describe(tb: TensorBoard) -> dict[str, Any]:
    """What the page is drawn from: runs, HParams columns ticked, Time Series groups (first two open)."""
    experiment = tb.hparams_experiment()
    tags = sorted({t for ts in tb.scalar_tags().values() for t in ts})
    layout = tb.custom_scalars_layout()
    return {
        "runs": tb.runs(),
        "hparams_ticked": ticked_hparams(experiment),
        "metrics_ticked": ticked_metrics(experiment),
        "timeseries_groups": timeseries_groups(tags),
        "custom_scalars": {c["title"]: [ch["title"] for ch in c["chart"]] for c in layout.get("category", [])},
        "sessions": len(tb.session_groups()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sweep", type=Path, help="a sweep folder; a missing one gets the tiny sweep (default: a temp one)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where the PNGs go (default: docs/)")
    args = parser.parse_args(argv)
    chromium = find_chromium()
    if chromium is None:
        print("error: no chromium on PATH (Debian: apt-get install -y chromium)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tb-sweep-") as tmp:
        sweep = args.sweep or Path(tmp) / "sweep"
        if not sweep.exists():
            tiny_sweep(sweep)
        with serving(sweep) as tb:
            print(json.dumps(describe(tb), indent=2))
            for name, png in photograph(tb, args.out, chromium).items():
                print(f"{name}: {png} ({png.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
