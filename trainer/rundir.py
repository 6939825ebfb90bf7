"""The run folder's bookkeeping that must work before Lightning loads: an atomic summary.json, and leaving nothing
behind when a run is refused before it starts."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

HYDRA_FILES = {".hydra", "train.log"}  # what Hydra writes into a run folder before our code runs


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _disposable(name: str) -> bool:
    """Hydra's files, or the TensorBoard event file a run refused at fit start (policy=auto) had opened."""
    return name in HYDRA_FILES or name.startswith("events.out.tfevents.")


def discard_run_dir(run_dir: Path) -> None:
    """A run refused before it started leaves nothing behind but Hydra's own files: remove those too, and the folders
    Hydra made for it that are now empty (runs/<date>/), up to the working directory."""
    if not (run_dir.is_dir() and all(_disposable(p.name) for p in run_dir.iterdir())):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    cwd = Path.cwd().resolve()
    for parent in run_dir.resolve().parents:
        if parent == cwd or cwd not in parent.parents or any(parent.iterdir()):
            break
        parent.rmdir()
