"""Where the text comes from and how it splits: the embedded corpus, local files (files, folders, globs; binary
and hidden entries skipped), a hub dataset (failing fast when offline), and the document-level train/val split."""

from __future__ import annotations

import glob
import logging
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from models import hub
from trainer.core.schema import DataConfig
from trainer.errors import DataError
from trainer.formatting import one_line

log = logging.getLogger("trainer.core.data")  # the data module's: one logger for everything about the corpus

# Bytes inspected for NUL when deciding whether a file is binary (same heuristic as git and grep).
BINARY_SNIFF_BYTES = 8192


# --------------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------------


def embedded_docs() -> list[str]:
    """The pydoc topics, one document each (PSF-2.0 licensed, shipped with CPython)."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def resolve_local_files(paths: Sequence[str]) -> list[Path]:
    """Expand files, folders and globs into a de-duplicated, deterministically ordered file list."""
    files: list[Path] = []
    seen: set[Path] = set()

    def add(p: Path) -> None:
        real = p.resolve()
        if real not in seen:
            seen.add(real)
            files.append(real)

    def add_tree(root: Path) -> None:
        for dirpath, dirnames, filenames in os.walk(root):
            # Sorting in place fixes os.walk's traversal order, so runs are reproducible across file systems.
            dirnames[:] = sorted(d for d in dirnames if not _is_hidden(d))
            for fn in sorted(filenames):
                f = Path(dirpath) / fn
                if not _is_hidden(fn) and f.is_file():
                    add(f)

    for raw in paths:
        entry = os.path.expanduser(str(raw))
        if glob.has_magic(entry):
            matches = sorted(glob.glob(entry, recursive=True))
            if not matches:
                raise DataError(f"data.path: glob {raw!r} matched nothing (cwd {os.getcwd()}); fix the pattern")
            for m in matches:
                mp = Path(m)
                if mp.is_dir():
                    add_tree(mp)
                elif mp.is_file():
                    add(mp)
            continue
        p = Path(entry)
        if not p.exists():
            raise DataError(
                f"data.path: {raw!r} does not exist (cwd {os.getcwd()}); give an existing file, folder or glob"
            )
        if p.is_dir():
            add_tree(p)
        else:
            add(p)
    if not files:
        raise DataError(f"data.path: {list(paths)} contains no files; point data.path at text files")
    return files


def _read_text_file(path: Path) -> str:
    data = path.read_bytes()
    if b"\x00" in data[:BINARY_SNIFF_BYTES]:
        raise DataError(
            f"data.path: {str(path)!r} looks binary (NUL bytes in its first 8 KiB); remove it or narrow "
            "data.path to text files (e.g. a glob like dir/**/*.txt)"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        text = data.decode("utf-8", errors="replace")
        # Replacement is a policy choice, not silent: say where and how much, once per file.
        log.warning(
            "%s is not valid UTF-8 (first bad byte at offset %d); decoded %d invalid sequence(s) as U+FFFD",
            path,
            exc.start,
            text.count("\ufffd") - data.count("\ufffd".encode()),
        )
    return text.removeprefix("\ufeff")


def local_docs(files: Sequence[Path]) -> list[str]:
    return [_read_text_file(f) for f in files]


def hub_docs(cfg: DataConfig) -> list[str]:
    import datasets

    name = str(cfg.name)
    where = f"{name!r}" + (f" ({cfg.config_name})" if cfg.config_name else "") + f" split {cfg.split!r}"
    local_fix = "use data.source=local data.path=<your text files>"

    def load() -> Any:
        return datasets.load_dataset(name, cfg.config_name, split=cfg.split)

    if hub.offline_requested():
        try:
            with hub.forced_offline():
                ds = load()
        except Exception as exc:
            raise DataError(
                f"cannot load hub dataset {where} offline and no cached copy: {one_line(exc, 300)}; "
                f"run once online to cache it or {local_fix}"
            ) from exc
    elif Path(name).exists():
        # A local dataset folder needs no hub; skip the probe.
        try:
            ds = load()
        except Exception as exc:
            raise DataError(f"cannot load dataset {where}: {one_line(exc, 300)}; check data.name") from exc
    else:
        ok, endpoint = hub.reachable()
        if ok:
            try:
                ds = load()
            except Exception as exc:
                raise DataError(
                    f"cannot load hub dataset {where}: {one_line(exc, 300)}; "
                    "check data.name, data.config_name and data.split"
                ) from exc
        else:
            log.warning("hub %s unreachable; trying a cached copy of %s", endpoint, name)
            try:
                with hub.forced_offline():
                    ds = load()
            except Exception as exc:
                raise DataError(
                    f"hub {endpoint} is unreachable and there is no cached copy of {where}: "
                    f"{one_line(exc, 300)}; {local_fix}"
                ) from exc

    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"hub dataset {where} did not load as one split; set data.split (e.g. data.split=train)")
    if cfg.text_field not in ds.column_names:
        raise DataError(
            f"data.text_field={cfg.text_field!r} is not a column of {name!r}; columns: {ds.column_names}; "
            "set data.text_field to one of them"
        )
    feature = ds.features[cfg.text_field]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(
            f"data.text_field={cfg.text_field!r} of {name!r} holds {feature}, not text; "
            f"pick a string column from {ds.column_names}"
        )
    return [t for t in ds[cfg.text_field] if t]


# --------------------------------------------------------------------------------------------------
# Split
# --------------------------------------------------------------------------------------------------


def _cut_near_newline(text: str, pos: int) -> int:
    """Index just after the newline nearest to `pos`, kept strictly inside the text so both sides
    are non-empty; falls back to `pos` itself for text without a usable newline."""
    pos = min(max(pos, 1), len(text) - 1)
    before = text.rfind("\n", 0, pos)
    after = text.find("\n", pos)
    candidates = [i + 1 for i in (before, after) if i != -1 and 0 < i + 1 < len(text)]
    if not candidates:
        return pos
    return min(candidates, key=lambda c: (abs(c - pos), c))


def split_documents(docs: Sequence[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Deterministic document-level train/val split.

    Splitting whole documents keeps val text unseen by the BPE trainer. Documents are visited in a
    seed-shuffled order and moved to val until val holds `val_fraction` of the characters. A document
    that alone would make val larger than train is skipped; if that leaves val short (always the case
    for a single big file), the largest train document is cut at the newline nearest the shortfall.
    """
    total = sum(len(d) for d in docs)
    target = val_fraction * total
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    in_val: set[int] = set()
    val_chars = 0
    for i in order:
        if val_chars >= target:
            break
        if val_chars + len(docs[i]) > total / 2:
            continue
        in_val.add(i)
        val_chars += len(docs[i])
    train = [docs[i] for i in order if i not in in_val]
    val = [docs[i] for i in order if i in in_val]
    shortfall = int(round(target - val_chars))
    if shortfall > 0 and train:
        big = max(range(len(train)), key=lambda j: len(train[j]))
        text = train[big]
        if len(text) >= 2:
            cut = _cut_near_newline(text, len(text) - shortfall)
            train[big], tail = text[:cut], text[cut:]
            val.append(tail)
    return train, val
