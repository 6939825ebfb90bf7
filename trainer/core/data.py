"""Text for the decoder, served as fixed-size blocks: prepared once into cached token files, streamed while the run
trains, or read from a token file the user brings. Memory stays bounded on every path: text is read a segment at a
time (trainer/core/corpus.py), tokenized in batches and written or packed as it comes (trainer/core/tokens.py,
trainer/core/stream.py).

Sources
-------
``embedded`` (default)
    The documentation topics shipped with every CPython as ``pydoc_data.topics`` (79 topics, ~465K
    characters of English prose and code). It is part of the Python distribution and therefore under
    the Python Software Foundation License (PSF-2.0), which permits redistribution and use; it is
    used here because it is real text that works with no download and no network.
``local``
    Files, folders (walked recursively, hidden entries skipped) and globs named in ``data.path``, in one format:
    plain text, JSON Lines or Parquet (``data.text_field``), a folder saved by ``save_to_disk``, or token ids
    (``.npy``, or a flat ``.bin`` of ``data.token_dtype``) read as they are.
``hub``
    ``datasets.load_dataset(name, config_name, split=split, streaming=...)[text_field]``, failing fast when offline.

Paths
-----
prepared (``data.streaming=false``, the default for embedded and local text)
    tokenized once into ``<cache_dir>/<key>/`` (train.bin, val.bin, meta.json and, for BPE, tokenizer.json), so
    the second run with the same inputs does no tokenization; blocks are shuffled per epoch.
streamed (``data.streaming=true``, the default for hub sources)
    tokenized and packed on the fly, split across data-parallel ranks, its position checkpointed; validation is the
    first held-out blocks, read once.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
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
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from trainer.core.corpus import FORMATS, Source, embedded_docs, split
from trainer.core.schema import DataConfig  # the `data` node of the config schema
from trainer.core.stream import HeldOutBlocks, TokenStream
from trainer.core.tokens import (
    BYTE_DOC_SEPARATOR,
    BYTE_VOCAB,
    EOT,
    Encoder,
    TokenBlocks,
    TokenWriter,
    check_token_file,
    load_bpe,
    open_tokens,
    train_bpe,
)
from trainer.errors import DataError

__all__ = ["BYTE_DOC_SEPARATOR", "EOT", "DataConfig", "DataError", "TextDataModule", "TokenBlocks"]

log = logging.getLogger(__name__)

# Bump whenever the on-disk layout or the tokenization of an unchanged corpus changes, so stale
# cache entries are never reused.
FORMAT_VERSION = 2

SOURCES = ("embedded", "local", "hub")
TOKENIZERS = ("byte", "bpe", "model")  # model: the Hugging Face model's own (model=hf)
TOKEN_DTYPES = ("uint8", "uint16", "uint32", "int32", "int64")
# Segments tokenized per tokenizer call on the prepared path.
WRITE_BATCH = 256


def _validate(cfg: DataConfig, seq_len: int, batch_size: int) -> None:
    if cfg.source not in SOURCES:
        raise DataError(f"data.source={cfg.source!r} is unknown; use one of {', '.join(SOURCES)}")
    if cfg.tokenizer not in TOKENIZERS:
        raise DataError(f"data.tokenizer={cfg.tokenizer!r} is unknown; use one of {', '.join(TOKENIZERS)}")
    if cfg.format not in FORMATS:
        raise DataError(f"data.format={cfg.format!r} is unknown; use one of {', '.join(FORMATS)}")
    if cfg.token_dtype is not None and cfg.token_dtype not in TOKEN_DTYPES:
        raise DataError(f"data.token_dtype={cfg.token_dtype!r} is unknown; use one of {', '.join(TOKEN_DTYPES)}")
    if not 0.0 < cfg.val_fraction <= 0.5:
        raise DataError(f"data.val_fraction={cfg.val_fraction} is out of range; use a value in (0, 0.5]")
    if cfg.tokenizer == "bpe" and cfg.bpe_vocab_size < BYTE_VOCAB + 1:
        # ByteLevel BPE always holds the 256 byte symbols plus the end-of-text token.
        raise DataError(
            f"data.bpe_vocab_size={cfg.bpe_vocab_size} is too small; use at least {BYTE_VOCAB + 1} "
            "(256 byte symbols + <|endoftext|>)"
        )
    if cfg.bpe_sample_chars < 1:
        raise DataError(f"data.bpe_sample_chars={cfg.bpe_sample_chars} must be at least 1 (characters of text)")
    if cfg.source == "local" and not cfg.path:
        raise DataError("data.source=local needs files: set data.path=[file, folder or glob, ...]")
    if cfg.source == "hub" and not cfg.name:
        raise DataError("data.source=hub needs a dataset: set data.name (e.g. data.name=wikitext)")
    if cfg.num_workers < 0:
        raise DataError(f"data.num_workers={cfg.num_workers} is negative; use 0 or more")
    if seq_len < 1 or batch_size < 1:
        raise DataError(f"seq_len={seq_len} and batch_size={batch_size} must both be at least 1")
    if cfg.max_tokens is not None and cfg.max_tokens < batch_size * (seq_len + 1):
        raise DataError(
            f"data.max_tokens={cfg.max_tokens} is less than one batch ({batch_size} x (seq_len {seq_len} + 1) = "
            f"{batch_size * (seq_len + 1)} tokens); raise it or unset it"
        )
    if streams(cfg) and cfg.num_workers:
        raise DataError(
            f"data.streaming=true reads in the training process, which checkpoints its position; "
            f"set data.num_workers=0 (got {cfg.num_workers})"
        )


def streams(cfg: DataConfig) -> bool:
    """Whether the corpus is streamed: data.streaming, or by default for a hub dataset."""
    return bool(cfg.streaming) if cfg.streaming is not None else cfg.source == "hub"


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


def _remove_stale_tmp_dirs(cache_dir: Path, max_age_s: float = 24 * 3600) -> None:
    """Drop temp dirs left by killed runs; young ones may belong to a run still writing."""
    now = time.time()
    for p in cache_dir.glob(".tmp-*"):
        with contextlib.suppress(OSError):
            if p.is_dir() and now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)


def _progress(total: int | None, desc: str) -> Any:
    """A progress bar over the source's bytes (an ETA where the size is known), tokens/s beside it."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, mininterval=1.0)


# --------------------------------------------------------------------------------------------------
# Loaders that resume
# --------------------------------------------------------------------------------------------------


class ResumableRandomSampler(Sampler[int]):
    """A fresh seeded permutation each epoch, a pure function of (seed, epoch), so any position can be replayed;
    data-parallel rank `rank` of `world` takes every world-th block of it (the permutation cut to a multiple of
    `world`, so every rank takes as many), as torch's DistributedSampler shards with drop_last.

    Lightning calls `set_epoch` at every epoch start. `resume_at(epoch, samples)` makes the next pass over that
    epoch skip the samples a killed run had already trained on (this rank's). Why not Lightning's distributed
    sampler: it wraps this one and shuffles its order again, so the skip would land nowhere and a resumed run of
    several ranks would start its epoch over.
    """

    def __init__(self, n: int, seed: int, rank: int = 0, world: int = 1) -> None:
        self.n = n
        self.seed = seed
        self.rank, self.world = rank, world
        self.epoch = 0
        self._resume: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, epoch: int, samples: int) -> None:
        self._resume = (epoch, samples)

    def __len__(self) -> int:
        return self.n // self.world

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.n, generator=g)
        if self.world > 1:
            order = order[: len(self) * self.world][self.rank :: self.world]
        skip = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            skip, self._resume = self._resume[1], None
        # A chunk of Python ints at a time: a 10 GB corpus has tens of millions of blocks, as a list ~1.5 GB.
        for chunk in order[skip:].split(1 << 16):
            yield from chunk.tolist()


def _same_batch_size(state: dict[str, int], batch_size: int | None) -> None:
    if state.get("batch_size") != batch_size:
        raise DataError(
            f"the checkpoint was trained with batch_size={state.get('batch_size')}, this run has "
            f"batch_size={batch_size}; resume with the same batch_size"
        )


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
        ranks = self.sampler.world if isinstance(self.sampler, ResumableRandomSampler) else 1
        return {"epoch": epoch, "batches": batches, "batch_size": int(self.batch_size or 1), "ranks": ranks}

    def load_state_dict(self, state: dict[str, int]) -> None:
        _same_batch_size(state, self.batch_size)
        sampler = self.sampler
        if isinstance(sampler, ResumableRandomSampler):
            if state.get("ranks", sampler.world) != sampler.world:  # positions count each rank's own share
                raise DataError(
                    f"the checkpoint was trained over {state['ranks']} data-parallel ranks, this run has "
                    f"{sampler.world}; resume with the same trainer.devices (and parallel layout)"
                )
            sampler.resume_at(state["epoch"], state["batches"] * state["batch_size"])


class StreamLoader(DataLoader):
    """The streamed train loader: its checkpointed state is where the next block to train on starts (from the
    trainer's batch counter, as ResumableDataLoader's), so a resume continues at that exact token."""

    dataset: TokenStream

    def __init__(self, *args: Any, position: Callable[[], tuple[int, int]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._position = position

    def state_dict(self) -> dict[str, int]:
        _, batches = self._position()
        size = int(self.batch_size or 1)
        return {**self.dataset.position(batches * size), "batch_size": size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        _same_batch_size(state, self.batch_size)
        if "segment" not in state:
            raise DataError("the checkpoint was trained on a prepared corpus; resume it with data.streaming=false")
        self.dataset.resume(state)


# --------------------------------------------------------------------------------------------------
# DataModule
# --------------------------------------------------------------------------------------------------


class TextDataModule(L.LightningDataModule):
    """Serves a text corpus (prepared and cached, streamed, or a token file) as [batch_size, seq_len] blocks."""

    def __init__(
        self,
        cfg: DataConfig,
        seq_len: int,
        batch_size: int,
        seed: int,
        tokenizer_from: str | None = None,
        val_blocks: int | None = None,
        val_batch_size: int | None = None,
    ) -> None:
        """`tokenizer_from`: the hub id or folder of the model whose tokenizer `data.tokenizer=model` uses.
        `val_blocks`: the held-out blocks a streamed corpus keeps for validation (default 8 batches).
        `val_batch_size`: the validation loader's batch (default `batch_size`; pipeline stages train on a step's
        micro-batches as one batch and validate on micro-batches)."""
        super().__init__()
        if isinstance(cfg.path, str):  # a single path given programmatically
            cfg.path = [cfg.path]
        check_config(cfg, seq_len, batch_size, tokenizer_from)
        self.tokenizer_from = tokenizer_from
        self._hf_tokenizer: Any = None
        self.cfg = cfg
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size  # None: batch_size, as it is when validation starts (auto may halve it)
        self.seed = seed
        self.val_blocks = val_blocks or 8 * batch_size
        self.cache_dir = Path(os.path.expanduser(cfg.cache_dir)) if cfg.cache_dir else default_cache_dir()
        self.streaming = streams(cfg)
        self.source = Source(cfg, streaming=self.streaming)
        self.tokens = self.source.format == "tokens"
        if self.tokens and self.streaming:
            raise DataError("data.path holds token ids, which are read as they are; set data.streaming=false")
        self._key: str | None = None
        self._description: dict[str, Any] | None = None
        self._prepared = False
        self._train: Dataset[Any] | None = None
        self._val: Dataset[Any] | None = None
        self._meta: dict[str, Any] | None = None
        self._encoder: Encoder | None = None

    # ---- cache key ------------------------------------------------------------------------------

    def _source_description(self) -> dict[str, Any]:
        """Everything that determines the token arrays; hashed into the cache key."""
        if self._description is not None:
            return self._description
        cfg = self.cfg
        desc: dict[str, Any] = {"source": cfg.source, "streaming": self.streaming}
        if cfg.source == "embedded":
            # Topics change between Python releases; hashing the content catches that exactly.
            h = hashlib.sha256()
            for doc in embedded_docs():
                h.update(doc.encode("utf-8", errors="surrogatepass") + b"\0")
            desc["content_sha256"] = h.hexdigest()
        elif cfg.source == "local":
            desc["format"] = self.source.format
            desc["text_field"] = cfg.text_field if self.source.format in ("json", "parquet", "arrow") else None
            desc["files"] = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in self.source.files]
        else:
            desc.update(name=cfg.name, config_name=cfg.config_name, split=cfg.split, text_field=cfg.text_field)
        if cfg.tokenizer == "model":
            tok = self._model_tokenizer()
            vocab = json.dumps(sorted(tok.get_vocab().items())).encode()
            desc["model_tokenizer"] = [self.tokenizer_from, type(tok).__name__, hashlib.sha256(vocab).hexdigest()]
        desc.update(
            tokenizer=cfg.tokenizer,
            bpe_vocab_size=cfg.bpe_vocab_size if cfg.tokenizer == "bpe" else None,
            bpe_sample_chars=cfg.bpe_sample_chars if cfg.tokenizer == "bpe" else None,
            max_tokens=None if self.streaming else cfg.max_tokens,
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
        return self.source.label

    # ---- Lightning hooks ------------------------------------------------------------------------

    def prepare_data(self) -> None:
        if self.tokens:
            self._prepared = True
            return
        entry = self.cache_path
        if (entry / "meta.json").is_file():
            # train.py and Lightning both call this; report the hit once per module.
            (log.debug if self._prepared else log.info)("using cached corpus %s", entry)
            self._prepared = True
            return
        self.source.check()
        t0 = time.perf_counter()
        self._build(entry)
        self._prepared = True
        log.info("prepared %s in %.1fs", entry, time.perf_counter() - t0)

    def _train_texts(self) -> Iterator[str]:
        return (s.text for s, held in split(self.source.segments(), self.cfg.val_fraction, self.seed) if not held)

    def _new_encoder(self, tmp: Path) -> Encoder:
        cfg = self.cfg
        if cfg.tokenizer == "byte":
            return Encoder("byte")
        if cfg.tokenizer == "model":
            return Encoder("model", self._model_tokenizer())
        sample: list[str] = []
        chars = 0
        for text in self._train_texts():
            sample.append(text[: cfg.bpe_sample_chars - chars])
            chars += len(sample[-1])
            if chars >= cfg.bpe_sample_chars:
                break
        log.info(
            "training BPE (vocab %d) on a sample of %s characters of the train split (data.bpe_sample_chars=%d)",
            cfg.bpe_vocab_size,
            f"{chars:,}",
            cfg.bpe_sample_chars,
        )
        tok = train_bpe(sample, cfg.bpe_vocab_size)
        tok.save(str(tmp / "tokenizer.json"))
        return Encoder("bpe", load_bpe(tmp / "tokenizer.json"))

    def _build(self, entry: Path) -> None:
        cfg = self.cfg
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp_dirs(self.cache_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=self.cache_dir))
        try:
            enc = self._new_encoder(tmp)
            meta: dict[str, Any] = {
                "format_version": FORMAT_VERSION,
                "source": self._source_label(),
                "description": self._source_description(),
                "tokenizer": cfg.tokenizer,
                "vocab_size": enc.vocab_size,
                "dtype": enc.dtype.name,
            }
            if not self.streaming:
                meta.update(self._write_tokens(enc, tmp))
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

    def _write_tokens(self, enc: Encoder, tmp: Path) -> dict[str, Any]:
        """Tokenize the source in batches of segments into train.bin and val.bin, never holding the corpus."""
        cfg = self.cfg
        log.info("tokenizing %s (tokenizer=%s) into %s", self._source_label(), cfg.tokenizer, tmp.parent)
        writers = {
            False: TokenWriter(tmp / "train.bin", enc.dtype, cfg.max_tokens),
            True: TokenWriter(tmp / "val.bin", enc.dtype),
        }
        docs = {False: 0, True: 0}
        chars = {False: 0, True: 0}
        t0 = time.perf_counter()
        bar = _progress(self.source.size, f"tokenizing {self._source_label()}")
        segments = split(self.source.segments(), cfg.val_fraction, self.seed)
        try:
            for batch in iter(lambda: list(itertools.islice(segments, WRITE_BATCH)), []):
                ids = enc.encode([s.text for s, _ in batch])
                for (s, held), x in zip(batch, ids, strict=True):
                    w = writers[held]
                    if s.opens:
                        docs[held] += 1
                        if w.n and len(enc.sep_ids):
                            w.write(enc.sep_ids)
                    w.write(x)
                    chars[held] += len(s.text)
                bar.update(sum(len(s.text.encode("utf-8", errors="surrogatepass")) for s, _ in batch))
                bar.set_postfix_str(f"{(writers[False].n + writers[True].n) / (time.perf_counter() - t0):,.0f} tok/s")
                if writers[False].full:
                    log.info("stopped at data.max_tokens=%d train tokens", cfg.max_tokens)
                    break
        finally:
            bar.close()
            for w in writers.values():
                w.close()
        if not chars[False] and not chars[True]:
            raise DataError(f"corpus {self._source_label()!r} has no text (only empty documents); give it text")
        return {
            "train_tokens": writers[False].n,
            "val_tokens": writers[True].n,
            "n_docs": {"train": docs[False], "val": docs[True]},
            "chars": {"train": chars[False], "val": chars[True]},
        }

    def setup(self, stage: str | None = None) -> None:
        if self._train is not None:
            return
        if self.tokens:
            self._setup_token_files()
            return
        entry = self.cache_path
        if not (entry / "meta.json").is_file():
            # Calling setup() alone should work too; prepare_data is idempotent and atomic.
            self.prepare_data()
        meta = json.loads((entry / "meta.json").read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise DataError(f"cache entry {entry} has another format; delete it and rerun")
        if meta["tokenizer"] == "bpe":
            self._encoder = Encoder("bpe", load_bpe(entry / "tokenizer.json"))
        elif meta["tokenizer"] == "model":
            self._encoder = Encoder("model", self._model_tokenizer())
        else:
            self._encoder = Encoder("byte")
        if self.streaming:
            val: Any = HeldOutBlocks(
                self.source, self._encoder, self.seq_len, self.cfg.val_fraction, self.seed, self.val_blocks
            )
            self._check_size(len(val) * (self.seq_len + 1), None, meta["source"], len(val), len(val))
            meta |= {"train_tokens": None, "val_tokens": val.n_tokens}
            self._meta, self._val = meta, val
            self._train = val  # placeholder until train_dataloader knows the rank: marks setup as done
            log.info(
                "corpus %s streams: vocab %d, %d held-out validation blocks",
                meta["source"],
                meta["vocab_size"],
                len(val),
            )
            return
        train = TokenBlocks(entry / "train.bin", self.seq_len, meta["dtype"])
        val = TokenBlocks(entry / "val.bin", self.seq_len, meta["dtype"])
        self._check_size(train.n_tokens, val.n_tokens, meta["source"], len(train), len(val))
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

    def _check_size(self, train_tokens: int | None, val_tokens: int | None, source: str, nt: int, nv: int) -> None:
        need = self.batch_size * (self.seq_len + 1)
        if nt < self.batch_size or nv < self.batch_size:
            have = f"{train_tokens} train / {val_tokens} val" if train_tokens is not None else f"{val_tokens} val"
            raise DataError(
                f"corpus {source!r} has {have} tokens but one batch needs {need} (batch_size {self.batch_size} x "
                f"(seq_len {self.seq_len} + 1)) in each; use a smaller seq_len or batch_size, a larger "
                "data.val_fraction, or more text"
            )

    def _setup_token_files(self) -> None:
        """Token ids the user brings: one file (its last val_fraction held out) or a train and a `val*` file."""
        cfg = self.cfg
        files = self.source.files
        val_files = [f for f in files if f.name.lower().startswith(("val", "validation"))]
        train_files = [f for f in files if f not in val_files]
        if len(train_files) != 1 or len(val_files) > 1:
            raise DataError(
                f"data.path: token ids are read from one file (its last data.val_fraction held out) or a train "
                f"file and a val* file; got {[f.name for f in files]}"
            )
        train_path = train_files[0]
        if cfg.tokenizer == "model":
            self._encoder = Encoder("model", self._model_tokenizer())
        ids = open_tokens(train_path, cfg.token_dtype)
        vocab = cfg.vocab_size or (self._encoder.vocab_size if self._encoder else None)
        if vocab is None:
            raise DataError(
                "data.path holds token ids: say their vocabulary with data.vocab_size=N (or data.tokenizer=model "
                "model=hf model.name_or_path=... for that model's tokenizer)"
            )
        check_token_file(train_path, ids, vocab)
        if val_files:
            val_ids = open_tokens(val_files[0], cfg.token_dtype)
            check_token_file(val_files[0], val_ids, vocab)
            train = TokenBlocks(train_path, self.seq_len, cfg.token_dtype)
            val = TokenBlocks(val_files[0], self.seq_len, cfg.token_dtype)
        else:
            cut = len(ids) - int(len(ids) * cfg.val_fraction)
            train = TokenBlocks(train_path, self.seq_len, cfg.token_dtype, 0, cut)
            val = TokenBlocks(train_path, self.seq_len, cfg.token_dtype, cut, len(ids))
        if cfg.max_tokens is not None and train.n_tokens > cfg.max_tokens:
            train = TokenBlocks(train_path, self.seq_len, cfg.token_dtype, train.start, train.start + cfg.max_tokens)
        label = f"tokens:{','.join(str(f) for f in files)}"
        self._check_size(train.n_tokens, val.n_tokens, label, len(train), len(val))
        self._meta = {
            "source": label,
            "tokenizer": cfg.tokenizer if cfg.tokenizer == "model" else None,
            "vocab_size": int(vocab),
            "dtype": ids.dtype.name,
            "train_tokens": train.n_tokens,
            "val_tokens": val.n_tokens,
        }
        self._train, self._val = train, val
        log.info("token file %s: vocab %d, %d train / %d val tokens", label, vocab, train.n_tokens, val.n_tokens)

    # ---- accessors ------------------------------------------------------------------------------

    def _require_setup(self) -> dict[str, Any]:
        if self._meta is None:
            raise RuntimeError("TextDataModule: call prepare_data() and setup() first")
        return self._meta

    @property
    def vocab_size(self) -> int:
        return int(self._require_setup()["vocab_size"])

    @property
    def train_tokens(self) -> int | None:
        """Tokens of the prepared train split; None when streamed (the stream has no end)."""
        n = self._require_setup()["train_tokens"]
        return None if n is None else int(n)

    @property
    def val_tokens(self) -> int:
        return int(self._require_setup()["val_tokens"])

    def describe(self, tokens_per_step: int, max_steps: int) -> str:
        """The run's first line about its data: where it comes from, whether it streams, what it will use."""
        meta = self._require_setup()
        used = tokens_per_step * max_steps
        how = (
            "streamed"
            if self.streaming
            else ("token file" if self.tokens else f"prepared, {meta['train_tokens']:,} train tokens")
        )
        epochs = "" if self.streaming or not meta["train_tokens"] else f", {used / meta['train_tokens']:.2f} epochs"
        return (
            f"data: {meta['source']} ({how}; tokenizer {self.cfg.tokenizer}, vocab {meta['vocab_size']}); "
            f"the run trains on {used:,} tokens ({max_steps} steps x {tokens_per_step:,}){epochs}"
        )

    def decode(self, ids: Sequence[int]) -> str:
        self._require_setup()
        return (self._encoder or Encoder("byte")).decode(ids)

    def encode(self, text: str) -> list[int]:
        """Inverse of decode (e.g. for sampling prompts)."""
        self._require_setup()
        return (self._encoder or Encoder("byte")).encode_text(text)

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

    def _rank(self) -> tuple[int, int]:
        """(data-parallel rank, ranks): a tensor-parallel group's ranks read the same blocks."""
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        kw = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}  # single-device: none
        return int(kw.get("rank", 0)), int(kw.get("num_replicas", 1))

    def _shard(self) -> tuple[int, int]:
        """(rank, ranks) the map-style loaders shard by themselves: the data-parallel ones, unless the Trainer adds
        Lightning's distributed sampler (its default; train.py turns it off), which then shards them as it always
        has, and cutting them here as well would leave each rank a share of a share."""
        connector = getattr(self.trainer, "_accelerator_connector", None)  # private: where Lightning keeps the flag
        if getattr(connector, "use_distributed_sampler", False):
            return 0, 1
        return self._rank()

    def train_dataloader(self) -> DataLoader:
        self._require_setup()
        assert self._train is not None
        if self.streaming:
            assert self._encoder is not None
            rank, world = self._rank()
            stream = TokenStream(
                self.source,
                self._encoder,
                self.seq_len,
                self.cfg.val_fraction,
                self.seed,
                rank=rank,
                world=world,
                max_tokens=self.cfg.max_tokens,
            )
            kwargs = self._loader_kwargs() | {"persistent_workers": False}
            return StreamLoader(stream, position=self._train_position, **kwargs)
        # The order is a function of the seed and the epoch alone, so a resumed run sees the same batches.
        sampler = ResumableRandomSampler(len(self._train), self.seed, *self._shard())  # type: ignore[arg-type]
        return ResumableDataLoader(self._train, sampler=sampler, position=self._train_position, **self._loader_kwargs())

    def val_dataloader(self) -> DataLoader:
        self._require_setup()
        assert self._val is not None
        rank, world = self._shard()
        kwargs = self._loader_kwargs() | {"batch_size": self.val_batch_size or self.batch_size}
        if world == 1:
            return DataLoader(self._val, shuffle=False, **kwargs)
        # Each data-parallel rank its share, in order, as Lightning's own distributed sampler shards validation
        sampler = DistributedSampler(self._val, num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(self._val, sampler=sampler, **kwargs)
