"""Where the text comes from, read as a stream of segments, and the held-out split that streams with it.

Every source is read lazily, one document at a time, and each document is cut at line ends into segments of at
most `segment_chars` characters; nothing ever holds the whole corpus. Sources: the embedded corpus; local files,
folders and globs in one format (plain text, JSON Lines, Parquet, or a dataset saved with `save_to_disk`), read
through `datasets` where the format is not plain text; a hub dataset, streamed or downloaded (failing fast when
offline). Pre-tokenized token files (`.bin`, `.npy`) are not text: trainer/core/tokens.py reads them.

The split is `HeldOut`, a streaming rule: a segment goes to validation while validation holds less than its share of
the characters seen so far. It needs no total, so the prepared and the streamed paths split alike, and a resumed
stream recomputes it by reading (not tokenizing) the text before its position.
"""

from __future__ import annotations

import codecs
import glob
import logging
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models import hub
from trainer.core.schema import DataConfig
from trainer.errors import DataError
from trainer.formatting import one_line

log = logging.getLogger("trainer.core.data")  # the data module's: one logger for everything about the corpus

# Bytes inspected for NUL when deciding whether a file is binary (same heuristic as git and grep).
BINARY_SNIFF_BYTES = 8192
# Segment size bounds. Where the corpus's size is known, a segment is about 1/16 of the validation share, so even a
# small corpus gives validation several segments; the cap bounds one tokenizer call's memory on a huge document.
MIN_SEGMENT_CHARS = 512
MAX_SEGMENT_CHARS = 1 << 16
SEGMENTS_PER_VAL_SHARE = 16

FORMATS = ("auto", "text", "json", "parquet", "arrow", "tokens")
_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz", ".jsonl.zst", ".json.zst")
_PARQUET_SUFFIXES = (".parquet",)
_TOKEN_SUFFIXES = (".bin", ".npy")


@dataclass(frozen=True)
class Segment:
    """A piece of one document, cut at a line end; `opens` marks a document's first piece (a separator goes
    before it, unless it is the first thing in its stream)."""

    text: str
    opens: bool


def embedded_docs() -> list[str]:
    """The pydoc topics, one document each (PSF-2.0 licensed, shipped with CPython)."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


# --------------------------------------------------------------------------------------------------
# Local files
# --------------------------------------------------------------------------------------------------


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def is_saved_dataset(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`."""
    return path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file())


def resolve_local_files(paths: Sequence[str]) -> list[Path]:
    """Expand files, folders and globs into a de-duplicated, deterministically ordered file list; a folder saved by
    `save_to_disk` is one entry, not walked."""
    files: list[Path] = []
    seen: set[Path] = set()

    def add(p: Path) -> None:
        real = p.resolve()
        if real not in seen:
            seen.add(real)
            files.append(real)

    def add_tree(root: Path) -> None:
        if is_saved_dataset(root):
            add(root)
            return
        for dirpath, dirnames, filenames in os.walk(root):
            # Sorting in place fixes os.walk's traversal order, so runs are reproducible across file systems.
            dirnames[:] = sorted(d for d in dirnames if not _is_hidden(d))
            for d in [d for d in dirnames if is_saved_dataset(Path(dirpath) / d)]:
                add(Path(dirpath) / d)  # a saved dataset is one entry: its arrow files are not text
                dirnames.remove(d)
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


def _format_of(path: Path) -> str:
    name = path.name.lower()
    if is_saved_dataset(path):
        return "arrow"
    if name.endswith(_JSON_SUFFIXES):
        return "json"
    if name.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(_TOKEN_SUFFIXES):
        return "tokens"
    return "text"


def local_format(files: Sequence[Path], declared: str) -> str:
    """The one format of `files`: `declared` (data.format), or read from their names when it is `auto`."""
    if declared not in FORMATS:
        raise DataError(f"data.format={declared!r} is unknown; use one of {', '.join(FORMATS)}")
    if declared != "auto":
        return declared
    kinds = {f: _format_of(f) for f in files}
    found = sorted(set(kinds.values()))
    if len(found) > 1:
        example = {k: next(str(f) for f, v in kinds.items() if v == k) for k in found}
        raise DataError(
            f"data.path mixes formats ({', '.join(f'{k}: {v}' for k, v in example.items())}); "
            "point data.path at files of one format, or set data.format to read them all as one"
        )
    return found[0]


def local_size(files: Sequence[Path]) -> int:
    """Bytes of the local source (a saved dataset's arrow files included): the progress bar's total."""
    total = 0
    for f in files:
        if f.is_dir():
            total += sum(p.stat().st_size for p in f.rglob("*.arrow"))
        else:
            total += f.stat().st_size
    return total


def _check_not_binary(path: Path, head: bytes) -> None:
    if b"\x00" in head[:BINARY_SNIFF_BYTES]:
        raise DataError(
            f"data.path: {str(path)!r} looks binary (NUL bytes in its first 8 KiB); remove it or narrow "
            "data.path to text files (e.g. a glob like dir/**/*.txt)"
        )


def check_text_files(files: Sequence[Path]) -> None:
    """Refuse a binary file before anything is written (its first 8 KiB are read)."""
    for f in files:
        with f.open("rb") as fh:
            _check_not_binary(f, fh.read(BINARY_SNIFF_BYTES))


def _file_pieces(path: Path, segment_chars: int) -> Iterator[str]:
    """A text file decoded incrementally and cut at line ends; invalid UTF-8 decodes as U+FFFD, said once."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    carry = ""
    offset = 0  # bytes decoded so far: where a bad byte is
    warned = False
    first = True
    with path.open("rb") as fh:
        while True:
            raw = fh.read(segment_chars)
            final = not raw
            try:
                text = decoder.decode(raw, final=final)
            except UnicodeDecodeError as exc:
                if not warned:
                    log.warning(
                        "%s is not valid UTF-8 (first bad byte at offset %d); decoding invalid sequences as U+FFFD",
                        path,
                        offset + exc.start,
                    )
                    warned = True
                pending = decoder.getstate()[0]
                decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
                text = decoder.decode(pending + raw, final=final)
            offset += len(raw)
            if first:
                text = text.removeprefix("\ufeff")
                first = False
            carry += text
            while len(carry) > segment_chars or (final and carry):
                end = min(segment_chars, len(carry))
                if end < len(carry):
                    nl = carry.rfind("\n", 0, end)
                    if nl > 0:
                        end = nl + 1
                yield carry[:end]
                carry = carry[end:]
            if final:
                return


def _text_pieces(doc: str, segment_chars: int) -> Iterator[str]:
    pos = 0
    while pos < len(doc):
        end = min(pos + segment_chars, len(doc))
        if end < len(doc):
            nl = doc.rfind("\n", pos, end)
            if nl > pos:
                end = nl + 1
        yield doc[pos:end]
        pos = end


def _segments_of(docs: Iterable[Iterable[str]]) -> Iterator[Segment]:
    """Documents given as their pieces → segments; a document's leading blank pieces (a blank document: all of
    it) are dropped, so an empty or whitespace-only document adds nothing."""
    for pieces in docs:
        opened = False
        for piece in pieces:
            if not opened and not piece.strip():
                continue
            yield Segment(piece, opens=not opened)
            opened = True


# --------------------------------------------------------------------------------------------------
# Records through `datasets`: JSON Lines, Parquet, a saved dataset, the hub
# --------------------------------------------------------------------------------------------------


def _text_column(rows: Any, where: str, field: str) -> Iterator[str]:
    """The `field` of every record, refusing (at the first record) a missing or non-text column."""
    checked = False
    for row in rows:
        if not checked:
            if field not in row:
                raise DataError(
                    f"data.text_field={field!r} is not a column of {where}; columns: {list(row)}; "
                    "set data.text_field to one of them"
                )
            if not isinstance(row[field], str) and row[field] is not None:
                raise DataError(
                    f"data.text_field={field!r} of {where} holds {type(row[field]).__name__}, not text; "
                    f"pick a string column from {list(row)}"
                )
            checked = True
        text = row[field]
        if text:
            yield text


def _check_features(ds: Any, where: str, field: str) -> None:
    features = getattr(ds, "features", None)
    if features is None:
        return  # a JSON stream's columns are known at its first record: _text_column checks there
    if field not in features:
        raise DataError(
            f"data.text_field={field!r} is not a column of {where}; columns: {list(features)}; "
            "set data.text_field to one of them"
        )
    if getattr(features[field], "dtype", None) not in ("string", "large_string"):
        raise DataError(
            f"data.text_field={field!r} of {where} holds {features[field]}, not text; "
            f"pick a string column from {list(features)}"
        )


def _local_records(files: Sequence[Path], fmt: str, cfg: DataConfig) -> tuple[Any, str]:
    import datasets

    where = f"{fmt} files {str(files[0])!r}" + (f" and {len(files) - 1} more" if len(files) > 1 else "")
    if fmt == "arrow":
        if len(files) != 1:
            raise DataError("data.path: a saved dataset (save_to_disk) is read alone; give that one folder")
        try:
            ds = datasets.load_from_disk(str(files[0]))
        except Exception as exc:
            raise DataError(f"cannot load the saved dataset {str(files[0])!r}: {one_line(exc, 300)}") from exc
        if isinstance(ds, datasets.DatasetDict):
            if cfg.split not in ds:
                raise DataError(
                    f"the saved dataset {str(files[0])!r} has splits {list(ds)}, not {cfg.split!r}; set data.split"
                )
            ds = ds[cfg.split]
        return ds, f"the saved dataset {str(files[0])!r}"
    try:
        ds = datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train", streaming=True)
    except Exception as exc:
        raise DataError(f"cannot read {where}: {one_line(exc, 300)}; check that they are {fmt}") from exc
    return ds, where


def hub_dataset(cfg: DataConfig, streaming: bool) -> Any:
    """`datasets.load_dataset(name, config_name, split=..., streaming=...)`, failing fast (one line) when offline."""
    import datasets

    name = str(cfg.name)
    where = f"{name!r}" + (f" ({cfg.config_name})" if cfg.config_name else "") + f" split {cfg.split!r}"
    local_fix = "use data.source=local data.path=<your text files>"

    def load() -> Any:
        return datasets.load_dataset(name, cfg.config_name, split=cfg.split, streaming=streaming)

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
    if not isinstance(ds, (datasets.Dataset, datasets.IterableDataset)):
        raise DataError(f"hub dataset {where} did not load as one split; set data.split (e.g. data.split=train)")
    return ds


# --------------------------------------------------------------------------------------------------
# One source
# --------------------------------------------------------------------------------------------------


class Source:
    """A configured source of text: `segments()` reads it from its start, each call anew.

    `size` is the source's size in bytes where it is known before reading (the embedded corpus, local files), else
    None; `segment_chars` follows from it and `data.val_fraction`, so a source always cuts the same way.
    """

    def __init__(self, cfg: DataConfig, streaming: bool = True) -> None:
        self.cfg = cfg
        self.streaming = streaming
        self.files: list[Path] = []
        self.format = "text"
        if cfg.source == "embedded":
            self.size: int | None = sum(len(d.encode()) for d in embedded_docs())
        elif cfg.source == "local":
            self.files = resolve_local_files(list(cfg.path))
            self.format = local_format(self.files, cfg.format)
            self.size = local_size(self.files)
        else:
            self.format = "hub"
            self.size = None
        if self.size is None:
            self.segment_chars = MAX_SEGMENT_CHARS
        else:
            share = self.size * cfg.val_fraction / SEGMENTS_PER_VAL_SHARE
            self.segment_chars = int(min(MAX_SEGMENT_CHARS, max(MIN_SEGMENT_CHARS, share)))

    @property
    def label(self) -> str:
        cfg = self.cfg
        if cfg.source == "embedded":
            return "embedded:pydoc_data.topics"
        if cfg.source == "local":
            return f"local:{','.join(map(str, cfg.path))}"
        return f"hub:{cfg.name}" + (f"/{cfg.config_name}" if cfg.config_name else "") + f":{cfg.split}"

    def check(self) -> None:
        """What can be refused before anything is read or written: binary text files, an empty corpus."""
        if self.format == "text" and self.files:
            if all(f.stat().st_size == 0 for f in self.files):
                raise DataError(f"data.path: {list(self.cfg.path)} holds only empty files; point it at text")
            check_text_files(self.files)

    def _documents(self) -> Iterator[Iterable[str]]:
        n = self.segment_chars
        cfg = self.cfg
        if cfg.source == "embedded":
            for doc in embedded_docs():
                yield _text_pieces(doc, n)
            return
        if self.format == "text":
            for f in self.files:
                yield _file_pieces(f, n)
            return
        if cfg.source == "local":
            ds, where = _local_records(self.files, self.format, cfg)
        else:
            ds = hub_dataset(cfg, self.streaming)
            where = f"{cfg.name!r}"
        _check_features(ds, where, cfg.text_field)
        for text in _text_column(ds, where, cfg.text_field):
            yield _text_pieces(text, n)

    def segments(self) -> Iterator[Segment]:
        yield from _segments_of(self._documents())


class HeldOut:
    """The train/validation split as a stream: a segment goes to validation once validation is owed (is short of
    `fraction` of the characters seen, this segment's included) a seed-chosen part of it, so it tracks the fraction
    within one segment at every point of the stream, for a corpus of any size and with no total known. The seed
    shifts where held-out segments fall, so another seed holds out other text.

    Example::

        held = HeldOut(0.05, seed=0)
        val = [held(len(s.text)) for s in source.segments()]   # True: validation
    """

    def __init__(self, fraction: float, seed: int) -> None:
        self.fraction = fraction
        # The seed's phase, in [0, 1): a golden-ratio sequence, so neighbouring seeds spread apart.
        self.phase = math.modf(seed * 0.6180339887498949)[0]
        self.seen = 0
        self.held = 0

    def __call__(self, chars: int) -> bool:
        self.seen += chars
        # Owed at least (1 - phase) of this segment: held-out stays within one segment of its share, either side.
        if self.fraction * self.seen - self.held >= (1 - self.phase) * chars:
            self.held += chars
            return True
        return False


def split(segments: Iterable[Segment], fraction: float, seed: int) -> Iterator[tuple[Segment, bool]]:
    """Each segment with whether it is held out for validation."""
    held = HeldOut(fraction, seed)
    for s in segments:
        yield s, held(len(s.text))
