"""The run folder's bookkeeping that must work before Lightning loads: an atomic summary.json, and leaving nothing
behind when a run is refused before it starts; and the tools' output files, checked before the work."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from trainer.errors import ConfigError

HYDRA_FILES = {".hydra", "train.log"}  # what Hydra writes into a run folder before our code runs


def write_text_atomic(path: Path, text: str) -> None:
    """The whole file or none of it (its missing folders made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def check_writable(flag: str, path: Path) -> None:
    """A file a tool's answer can be written to (its missing folders made then), refused in one line before any
    work. The nearest existing folder is tried with a file that vanishes on close, not os.access: root passes that
    everywhere, /proc included."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file path in it, such as {path / 'out.json'}")
    folder = next((p for p in (path.parent, *path.parent.parents) if p.exists()), Path("."))
    try:
        if not folder.is_dir():
            raise NotADirectoryError(folder)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        raise ConfigError(f"{flag} {path}: cannot write under {folder}; give a path in a writable folder") from None


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
