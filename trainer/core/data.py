"""Text for the decoder: a corpus (trainer/core/corpus.py) split, tokenized once, cached, served as fixed-size blocks.

Sources
-------
``embedded`` (default)
    The documentation topics shipped with every CPython as ``pydoc_data.topics`` (79 topics, ~465K
    characters of English prose and code). It is part of the Python distribution and therefore under
    the Python Software Foundation License (PSF-2.0), which permits redistribution and use; it is
    used here because it is real text that works with no download and no network.
``local``
    Files, folders (walked recursively, hidden entries skipped) and globs named in ``data.path``.
``hub``
    ``datasets.load_dataset(name, config_name, split=split)[text_field]``, failing fast when offline.

Every prepared corpus is cached under ``<cache_dir>/<key>/`` (train.npy, val.npy, meta.json and, for
BPE, tokenizer.json), so the second ``prepare_data()`` with the same inputs does no tokenization.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from trainer.core.corpus import (
    embedded_docs,
    hub_docs,
    local_docs,
    resolve_local_files,
    split_documents,
)
from trainer.core.schema import DataConfig  # the `data` node of the config schema
from trainer.errors import DataError

log = logging.getLogger(__name__)

# Bump whenever the on-disk layout or the tokenization of an unchanged corpus changes, so stale
# cache entries are never reused.
FORMAT_VERSION = 1

SOURCES = ("embedded", "local", "hub")
TOKENIZERS = ("byte", "bpe", "model")  # model: the Hugging Face model's own (model=hf)
EOT = "<|endoftext|>"
BYTE_VOCAB = 256
BYTE_DOC_SEPARATOR = "\n\n"
# Documents are cut into pieces of at most this many characters before tokenization, so one huge
# local file still gets a moving progress bar and bounded per-batch memory.
PIECE_CHARS = 1 << 18


def _validate(cfg: DataConfig, seq_len: int, batch_size: int) -> None:
    if cfg.source not in SOURCES:
        raise DataError(f"data.source={cfg.source!r} is unknown; use one of {', '.join(SOURCES)}")
    if cfg.tokenizer not in TOKENIZERS:
        raise DataError(f"data.tokenizer={cfg.tokenizer!r} is unknown; use one of {', '.join(TOKENIZERS)}")
    if not 0.0 < cfg.val_fraction <= 0.5:
        raise DataError(f"data.val_fraction={cfg.val_fraction} is out of range; use a value in (0, 0.5]")
    if cfg.tokenizer == "bpe" and cfg.bpe_vocab_size < BYTE_VOCAB + 1:
        # ByteLevel BPE always holds the 256 byte symbols plus the end-of-text token.
        raise DataError(
            f"data.bpe_vocab_size={cfg.bpe_vocab_size} is too small; use at least {BYTE_VOCAB + 1} "
            "(256 byte symbols + <|endoftext|>)"
        )
    if cfg.source == "local" and not cfg.path:
        raise DataError("data.source=local needs files: set data.path=[file, folder or glob, ...]")
    if cfg.source == "hub" and not cfg.name:
        raise DataError("data.source=hub needs a dataset: set data.name (e.g. data.name=wikitext)")
    if cfg.num_workers < 0:
        raise DataError(f"data.num_workers={cfg.num_workers} is negative; use 0 or more")
    if seq_len < 1 or batch_size < 1:
        raise DataError(f"seq_len={seq_len} and batch_size={batch_size} must both be at least 1")


def check_config(cfg: DataConfig, seq_len: int, batch_size: int, tokenizer_from: str | None) -> None:
    """What the data settings must satisfy before anything is read: the run's rule, which the estimator (which
    reads no data) applies too. `tokenizer_from`: the model data.tokenizer=model takes its tokenizer from."""
    _validate(cfg, seq_len, batch_size)
    if cfg.tokenizer == "model" and not tokenizer_from:
        raise DataError(
            "data.tokenizer=model uses a Hugging Face model's tokenizer: it needs model=hf "
            "model.name_or_path=...; use data.tokenizer=byte or bpe for this model"
        )


def default_cache_dir() -> Path:
    return Path(os.environ.get("CKPTLAB_CACHE") or Path.home() / ".cache" / "ckptlab" / "data")


# --------------------------------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------------------------------


def _pieces(docs: Sequence[str]) -> tuple[list[str], list[bool]]:
    """Cut documents into <= PIECE_CHARS pieces at line ends; `starts` marks a piece that opens a
    document after the first, i.e. where the document separator goes."""
    texts: list[str] = []
    starts: list[bool] = []
    for d, doc in enumerate(docs):
        pos = 0
        while pos < len(doc):
            end = min(pos + PIECE_CHARS, len(doc))
            if end < len(doc):
                nl = doc.rfind("\n", pos, end)
                if nl > pos:
                    end = nl + 1
            texts.append(doc[pos:end])
            starts.append(d > 0 and pos == 0)
            pos = end
    return texts, starts


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def _tokenize_to_npy(docs: Sequence[str], encode: Any, sep: list[int], dtype: np.dtype, out: Path, desc: str) -> int:
    """Tokenize through a `datasets` map (batched, with a progress bar) and stream the ids into a
    .npy file without ever holding a Python list of the whole corpus."""
    import datasets
    import pyarrow.compute as pc

    texts, starts = _pieces(docs)
    sep_arr = np.asarray(sep, dtype=dtype)

    def batch_fn(batch: dict[str, list[Any]]) -> dict[str, list[np.ndarray]]:
        ids = encode(batch["text"])
        return {
            "ids": [
                np.concatenate([sep_arr, np.asarray(x, dtype=dtype)]) if s else np.asarray(x, dtype=dtype)
                for x, s in zip(ids, batch["start"], strict=True)
            ]
        }

    ds = datasets.Dataset.from_dict({"text": texts, "start": starts})
    ds = ds.map(batch_fn, batched=True, batch_size=64, remove_columns=["text", "start"], desc=desc)
    chunks = ds.data.column("ids").chunks
    total = int(sum(pc.sum(pc.list_value_length(c)).as_py() or 0 for c in chunks))
    arr = np.lib.format.open_memmap(out, mode="w+", dtype=dtype, shape=(total,))
    pos = 0
    for c in chunks:
        flat = pc.list_flatten(c).to_numpy(zero_copy_only=False)
        arr[pos : pos + len(flat)] = flat
        pos += len(flat)
    arr.flush()
    del arr
    return total


def _byte_encode(texts: list[str]) -> list[np.ndarray]:
    return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


def _train_bpe(train_docs: Sequence[str], vocab_size: int) -> Any:
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    texts, _ = _pieces(train_docs)
    tok.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT], show_progress=True, length=len(texts)
    )
    return tok


def _remove_stale_tmp_dirs(cache_dir: Path, max_age_s: float = 24 * 3600) -> None:
    """Drop temp dirs left by killed runs; young ones may belong to a run still writing."""
    now = time.time()
    for p in cache_dir.glob(".tmp-*"):
        with contextlib.suppress(OSError):
            if p.is_dir() and now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------------------------------


class TokenBlocks(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping blocks of seq_len + 1 tokens from a cached token array, as (x, y = x shifted)."""

    def __init__(self, path: Path, seq_len: int) -> None:
        self.path = path
        self.block = seq_len + 1
        self._tokens: np.ndarray | None = None
        self.n_tokens = len(self.tokens)

    @property
    def tokens(self) -> np.ndarray:
        # Opened lazily so worker processes map the file themselves instead of receiving a pickled copy.
        if self._tokens is None:
            self._tokens = np.load(self.path, mmap_mode="r")
        return self._tokens

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tokens"] = None
        return state

    def __len__(self) -> int:
        return self.n_tokens // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        chunk = torch.from_numpy(self.tokens[i * self.block : (i + 1) * self.block].astype(np.int64))
        return chunk[:-1], chunk[1:]


class ResumableRandomSampler(Sampler[int]):
    """A fresh seeded permutation each epoch, a pure function of (seed, epoch), so any position can be replayed.

    Lightning calls `set_epoch` at every epoch start. `resume_at(epoch, samples)` makes the next pass over that
    epoch skip the samples a killed run had already trained on.
    """

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self.epoch = 0
        self._resume: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, epoch: int, samples: int) -> None:
        self._resume = (epoch, samples)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        skip = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            skip, self._resume = self._resume[1], None
        yield from order[skip:]


class ResumableDataLoader(DataLoader):
    """A train loader whose position Lightning saves in checkpoints and restores on resume.

    Lightning keeps the `state_dict()` of any train loader that has one and hands it back through
    `load_state_dict()` before iterating (its `_Stateful` check); without this a mid-epoch resume replays the
    epoch from its start. The position is read from the trainer's batch counter, not from this iterator, which
    runs a batch ahead (Lightning prefetches one).
    """

    def __init__(self, *args: Any, position: Callable[[], tuple[int, int]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._position = position

    def state_dict(self) -> dict[str, int]:
        epoch, batches = self._position()
        return {"epoch": epoch, "batches": batches, "batch_size": int(self.batch_size or 1)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("batch_size") != self.batch_size:
            raise DataError(
                f"the checkpoint was trained with batch_size={state.get('batch_size')}, this run has "
                f"batch_size={self.batch_size}; resume with the same batch_size"
            )
        sampler = self.sampler
        if isinstance(sampler, ResumableRandomSampler):
            sampler.resume_at(state["epoch"], state["batches"] * state["batch_size"])


# --------------------------------------------------------------------------------------------------
# DataModule
# --------------------------------------------------------------------------------------------------


class TextDataModule(L.LightningDataModule):
    """Prepares (once, cached) and serves a tokenized text corpus as [batch_size, seq_len] blocks."""

    def __init__(
        self, cfg: DataConfig, seq_len: int, batch_size: int, seed: int, tokenizer_from: str | None = None
    ) -> None:
        """`tokenizer_from`: the hub id or folder of the model whose tokenizer `data.tokenizer=model` uses."""
        super().__init__()
        if isinstance(cfg.path, str):  # a single path given programmatically
            cfg.path = [cfg.path]
        check_config(cfg, seq_len, batch_size, tokenizer_from)
        self.tokenizer_from = tokenizer_from
        self._hf_tokenizer: Any = None
        self.cfg = cfg
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.cache_dir = Path(os.path.expanduser(cfg.cache_dir)) if cfg.cache_dir else default_cache_dir()
        self._key: str | None = None
        self._description: dict[str, Any] | None = None
        self._prepared = False
        self._train: TokenBlocks | None = None
        self._val: TokenBlocks | None = None
        self._meta: dict[str, Any] | None = None
        self._tokenizer: Any = None

    # ---- cache key ------------------------------------------------------------------------------

    def _source_description(self) -> dict[str, Any]:
        """Everything that determines the token arrays; hashed into the cache key."""
        if self._description is not None:
            return self._description
        cfg = self.cfg
        desc: dict[str, Any] = {"source": cfg.source}
        if cfg.source == "embedded":
            # Topics change between Python releases; hashing the content catches that exactly.
            h = hashlib.sha256()
            for doc in embedded_docs():
                h.update(doc.encode("utf-8", errors="surrogatepass") + b"\0")
            desc["content_sha256"] = h.hexdigest()
        elif cfg.source == "local":
            files = resolve_local_files(list(cfg.path))
            stats = [(str(f), f.stat()) for f in files]
            if all(s.st_size == 0 for _, s in stats):
                raise DataError(f"data.path: {list(cfg.path)} holds only empty files; point it at text")
            desc["files"] = [[name, s.st_size, s.st_mtime_ns] for name, s in stats]
        else:
            desc.update(name=cfg.name, config_name=cfg.config_name, split=cfg.split, text_field=cfg.text_field)
        if cfg.tokenizer == "model":
            tok = self._model_tokenizer()
            vocab = json.dumps(sorted(tok.get_vocab().items())).encode()
            desc["model_tokenizer"] = [self.tokenizer_from, type(tok).__name__, hashlib.sha256(vocab).hexdigest()]
        desc.update(
            tokenizer=cfg.tokenizer,
            bpe_vocab_size=cfg.bpe_vocab_size if cfg.tokenizer == "bpe" else None,
            val_fraction=cfg.val_fraction,
            seed=self.seed,
            format_version=FORMAT_VERSION,
        )
        self._description = desc
        return desc

    def _model_tokenizer(self) -> Any:
        if self._hf_tokenizer is None:
            from models.hf import load_tokenizer

            self._hf_tokenizer = load_tokenizer(str(self.tokenizer_from))
        return self._hf_tokenizer

    @property
    def cache_key(self) -> str:
        if self._key is None:
            blob = json.dumps(self._source_description(), sort_keys=True).encode()
            self._key = hashlib.sha256(blob).hexdigest()[:16]
        return self._key

    @property
    def cache_path(self) -> Path:
        return self.cache_dir / self.cache_key

    def _source_label(self) -> str:
        cfg = self.cfg
        if cfg.source == "embedded":
            return "embedded:pydoc_data.topics"
        if cfg.source == "local":
            return f"local:{','.join(map(str, cfg.path))}"
        return f"hub:{cfg.name}" + (f"/{cfg.config_name}" if cfg.config_name else "") + f":{cfg.split}"

    # ---- Lightning hooks ------------------------------------------------------------------------

    def prepare_data(self) -> None:
        entry = self.cache_path
        if (entry / "meta.json").is_file():
            # train.py and Lightning both call this; report the hit once per module.
            (log.debug if self._prepared else log.info)("using cached corpus %s", entry)
            self._prepared = True
            return
        t0 = time.perf_counter()
        self._build(entry)
        self._prepared = True
        log.info("prepared corpus %s in %.1fs", entry, time.perf_counter() - t0)

    def _load_docs(self) -> list[str]:
        cfg = self.cfg
        if cfg.source == "embedded":
            docs = embedded_docs()
        elif cfg.source == "local":
            docs = local_docs(resolve_local_files(list(cfg.path)))
        else:
            docs = hub_docs(cfg)
        docs = [d for d in docs if d.strip()]
        if not docs:
            raise DataError(f"corpus {self._source_label()!r} has no text (only empty documents); give it text")
        return docs

    def _build(self, entry: Path) -> None:
        cfg = self.cfg
        docs = self._load_docs()
        train_docs, val_docs = split_documents(docs, cfg.val_fraction, self.seed)
        if not train_docs or not val_docs:
            raise DataError(
                f"corpus {self._source_label()!r} is too small to split ({sum(map(len, docs))} chars); "
                "add text or raise data.val_fraction"
            )
        log.info(
            "tokenizing %s: %d train / %d val documents, %d chars, tokenizer=%s",
            self._source_label(),
            len(train_docs),
            len(val_docs),
            sum(map(len, docs)),
            cfg.tokenizer,
        )
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp_dirs(self.cache_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=self.cache_dir))
        try:
            if cfg.tokenizer == "byte":
                vocab_size = BYTE_VOCAB
                encode: Any = _byte_encode
                sep = list(BYTE_DOC_SEPARATOR.encode())
            elif cfg.tokenizer == "model":
                hf_tok = self._model_tokenizer()
                vocab_size = len(hf_tok)
                boundary = hf_tok.eos_token_id if hf_tok.eos_token_id is not None else hf_tok.bos_token_id

                def encode(texts: list[str]) -> list[list[int]]:
                    return hf_tok(texts, add_special_tokens=False)["input_ids"]

                sep = [] if boundary is None else [int(boundary)]
            else:
                tok = _train_bpe(train_docs, cfg.bpe_vocab_size)
                tok.save(str(tmp / "tokenizer.json"))
                vocab_size = tok.get_vocab_size()
                eot = tok.token_to_id(EOT)

                def encode(texts: list[str]) -> list[list[int]]:
                    return [e.ids for e in tok.encode_batch(texts)]

                sep = [eot]
            dtype = _token_dtype(vocab_size)
            n_train = _tokenize_to_npy(train_docs, encode, sep, dtype, tmp / "train.npy", "tokenizing train")
            n_val = _tokenize_to_npy(val_docs, encode, sep, dtype, tmp / "val.npy", "tokenizing val")
            meta = {
                "format_version": FORMAT_VERSION,
                "source": self._source_label(),
                "description": self._source_description(),
                "tokenizer": cfg.tokenizer,
                "vocab_size": vocab_size,
                "dtype": dtype.name,
                "train_tokens": n_train,
                "val_tokens": n_val,
                "n_docs": {"train": len(train_docs), "val": len(val_docs)},
                "chars": {"train": sum(map(len, train_docs)), "val": sum(map(len, val_docs))},
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
            try:
                os.replace(tmp, entry)
            except OSError:
                # A concurrent run placed the same entry first; its content is identical by construction.
                if not (entry / "meta.json").is_file():
                    raise
                log.info("corpus %s was prepared concurrently; using that copy", entry)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def setup(self, stage: str | None = None) -> None:
        if self._train is not None:
            return
        entry = self.cache_path
        if not (entry / "meta.json").is_file():
            # Calling setup() alone should work too; prepare_data is idempotent and atomic.
            self.prepare_data()
        meta = json.loads((entry / "meta.json").read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise DataError(f"cache entry {entry} has another format; delete it and rerun")
        train = TokenBlocks(entry / "train.npy", self.seq_len)
        val = TokenBlocks(entry / "val.npy", self.seq_len)
        need = self.batch_size * (self.seq_len + 1)
        if len(train) < self.batch_size or len(val) < self.batch_size:
            raise DataError(
                f"corpus {meta['source']!r} has {train.n_tokens} train / {val.n_tokens} val tokens but one "
                f"batch needs {need} (batch_size {self.batch_size} x (seq_len {self.seq_len} + 1)) in each; "
                "use a smaller seq_len or batch_size, a larger data.val_fraction, or more text"
            )
        if meta["tokenizer"] == "bpe":
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(entry / "tokenizer.json"))
        elif meta["tokenizer"] == "model":
            self._tokenizer = self._model_tokenizer()
        self._meta, self._train, self._val = meta, train, val
        log.info(
            "corpus %s: vocab %d, %d train tokens (%d blocks), %d val tokens (%d blocks)",
            meta["source"],
            meta["vocab_size"],
            train.n_tokens,
            len(train),
            val.n_tokens,
            len(val),
        )

    # ---- accessors ------------------------------------------------------------------------------

    def _require_setup(self) -> dict[str, Any]:
        if self._meta is None:
            raise RuntimeError("TextDataModule: call prepare_data() and setup() first")
        return self._meta

    @property
    def vocab_size(self) -> int:
        return int(self._require_setup()["vocab_size"])

    @property
    def train_tokens(self) -> int:
        return int(self._require_setup()["train_tokens"])

    @property
    def val_tokens(self) -> int:
        return int(self._require_setup()["val_tokens"])

    def decode(self, ids: Sequence[int]) -> str:
        self._require_setup()
        ids = [int(i) for i in ids]
        if self._tokenizer is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self._tokenizer.decode(ids, skip_special_tokens=False)  # tokenizers' and transformers' alike

    def encode(self, text: str) -> list[int]:
        """Inverse of decode (e.g. for sampling prompts)."""
        self._require_setup()
        if self._tokenizer is None:
            return list(text.encode("utf-8"))
        if self._hf_tokenizer is not None:
            return list(self._tokenizer.encode(text, add_special_tokens=False))
        return list(self._tokenizer.encode(text).ids)

    def _loader_kwargs(self) -> dict[str, Any]:
        workers = self.cfg.num_workers
        return {
            "batch_size": self.batch_size,
            "drop_last": True,  # every batch full-shape; setup() guarantees at least one batch
            "num_workers": workers,
            "persistent_workers": workers > 0,
            "pin_memory": torch.cuda.is_available(),
            # Each new iterator draws a base seed; from its own generator, not the global RNG, so an iterator
            # made on resume (or for a validation) never shifts the dropout masks of the steps that follow.
            "generator": torch.Generator().manual_seed(self.seed),
        }

    def _train_position(self) -> tuple[int, int]:
        """(epoch, micro-batches of it already trained on), from the trainer's own counters."""
        trainer = self.trainer
        if trainer is None:
            return 0, 0
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        return trainer.current_epoch, progress.processed

    def train_dataloader(self) -> DataLoader:
        self._require_setup()
        assert self._train is not None
        # The order is a function of the seed and the epoch alone, so a resumed run sees the same batches.
        sampler = ResumableRandomSampler(len(self._train), self.seed)
        return ResumableDataLoader(self._train, sampler=sampler, position=self._train_position, **self._loader_kwargs())

    def val_dataloader(self) -> DataLoader:
        self._require_setup()
        assert self._val is not None
        return DataLoader(self._val, shuffle=False, **self._loader_kwargs())
