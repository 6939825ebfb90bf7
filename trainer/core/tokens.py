"""Text to token ids and token ids on disk: the tokenizers (byte, BPE trained on a sample, a model's own), the
token arrays a prepared corpus writes and a pre-tokenized file a user brings, and the blocks a run trains on.

A token array is a flat file of ids in the narrowest unsigned dtype that holds the vocabulary (nanoGPT's `.bin`
layout) or a `.npy` of ids; both are memory-mapped, never loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.errors import DataError

log = logging.getLogger("trainer.core.data")

EOT = "<|endoftext|>"
BYTE_VOCAB = 256
BYTE_DOC_SEPARATOR = "\n\n"
# A pre-tokenized file is checked for ids past the vocabulary this many ids at a time (bounded memory).
SCAN_IDS = 1 << 26


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


class Encoder:
    """One tokenizer behind one interface: `encode` a batch of texts to id arrays, `sep` between documents,
    `vocab_size`, `decode`. `bpe` and `model` encode a batch on all cores (the tokenizers library's own threads)."""

    def __init__(self, kind: str, tokenizer: Any = None) -> None:
        self.kind = kind
        self.tokenizer = tokenizer
        if kind == "byte":
            self.vocab_size = BYTE_VOCAB
            self.sep = list(BYTE_DOC_SEPARATOR.encode())
        elif kind == "bpe":
            self.vocab_size = int(tokenizer.get_vocab_size())
            self.sep = [int(tokenizer.token_to_id(EOT))]
        else:  # a Hugging Face model's tokenizer
            self.vocab_size = len(tokenizer)
            boundary = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
            self.sep = [] if boundary is None else [int(boundary)]
        self.dtype = token_dtype(self.vocab_size)
        self.sep_ids = np.asarray(self.sep, dtype=self.dtype)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        if self.kind == "byte":
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(self.dtype) for t in texts]
        if self.kind == "bpe":
            ids = [e.ids for e in self.tokenizer.encode_batch(texts)]
        else:
            ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [np.asarray(x, dtype=self.dtype) for x in ids]

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "byte":
            return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=False)  # tokenizers' and transformers' alike

    def encode_text(self, text: str) -> list[int]:
        if self.kind == "byte":
            return list(text.encode("utf-8"))
        if self.kind == "model":
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return list(self.tokenizer.encode(text).ids)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE (GPT-2's kind) trained on `texts`, with <|endoftext|> as its one special token."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT], show_progress=True)
    return tok


def load_bpe(path: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


class TokenWriter:
    """Appends id arrays to a flat token file; `stop` (ids) truncates at a budget."""

    def __init__(self, path: Path, dtype: np.dtype, stop: int | None = None) -> None:
        self.path, self.dtype, self.stop = path, dtype, stop
        self.n = 0
        self._fh = path.open("wb")

    @property
    def full(self) -> bool:
        return self.stop is not None and self.n >= self.stop

    def write(self, ids: np.ndarray) -> None:
        if self.stop is not None:
            ids = ids[: max(0, self.stop - self.n)]
        self._fh.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        self.n += len(ids)

    def close(self) -> None:
        self._fh.close()


def open_tokens(path: Path, dtype: str | None = None) -> np.ndarray:
    """A token file memory-mapped: a `.npy` (its own dtype) or a flat `.bin` of `dtype`."""
    if path.suffix == ".npy":
        try:
            return np.load(path, mmap_mode="r")
        except (ValueError, OSError) as exc:
            raise DataError(f"data.path: {str(path)!r} is not a readable .npy of token ids ({exc})") from exc
    if dtype is None:
        raise DataError(f"data.path: {str(path)!r} is a flat token file; say its ids' type with data.token_dtype")
    if path.stat().st_size == 0:
        return np.empty(0, dtype=np.dtype(dtype))  # mmap refuses an empty file
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


def check_token_file(path: Path, ids: np.ndarray, vocab_size: int) -> None:
    """Refuse a token file whose dtype cannot be ids, or whose ids do not fit `vocab_size` (scanned in chunks)."""
    kind = ids.dtype
    if kind.kind not in "ui":
        raise DataError(f"data.path: {str(path)!r} holds {kind} values, not integer token ids; give a file of ids")
    if len(ids) == 0:
        raise DataError(f"data.path: {str(path)!r} holds no tokens; give a file of token ids")
    top = int(np.iinfo(kind).max)
    if top < vocab_size - 1:
        raise DataError(
            f"data.path: {str(path)!r} stores {kind} ids (at most {top}) but the vocabulary has {vocab_size} ids; "
            f"set data.token_dtype to the type it was written with (e.g. {token_dtype(vocab_size).name})"
        )
    biggest, lowest = 0, 0
    for start in range(0, len(ids), SCAN_IDS):
        chunk = ids[start : start + SCAN_IDS]
        biggest = max(biggest, int(chunk.max()))
        lowest = min(lowest, int(chunk.min()))
    if biggest >= vocab_size or lowest < 0:
        raise DataError(
            f"data.path: {str(path)!r} holds id {biggest if biggest >= vocab_size else lowest}, outside the "
            f"vocabulary of {vocab_size}; check data.token_dtype and data.vocab_size (or data.tokenizer=model)"
        )


class TokenBlocks(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping blocks of seq_len + 1 tokens from ids [start, stop) of a token file, as (x, y = x shifted)."""

    def __init__(
        self, path: Path, seq_len: int, dtype: str | None = None, start: int = 0, stop: int | None = None
    ) -> None:
        self.path, self.dtype = path, dtype
        self.block = seq_len + 1
        self._tokens: np.ndarray | None = None
        self.start = start
        self.stop = len(self.tokens) if stop is None else stop
        self.n_tokens = self.stop - self.start

    @property
    def tokens(self) -> np.ndarray:
        # Opened lazily so worker processes map the file themselves instead of receiving a pickled copy.
        if self._tokens is None:
            self._tokens = open_tokens(self.path, self.dtype)
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
        at = self.start + i * self.block
        chunk = torch.from_numpy(self.tokens[at : at + self.block].astype(np.int64))
        return chunk[:-1], chunk[1:]
