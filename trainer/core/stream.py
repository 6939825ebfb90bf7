"""A source tokenized and packed while the run trains: torchtitan's streamed dataset, as a resumable torch
`IterableDataset`, and the fixed held-out blocks its validation uses.

Nearest in torch and Hugging Face: `datasets.distributed.split_dataset_by_node` splits a stream by rank and
`datasets.IterableDataset.state_dict` checkpoints a shard position; ours splits the segments of any source
(local files read by us, JSON/Parquet/hub through `datasets`) round-robin by data-parallel rank, and records the
exact token at which each block starts, so a run killed and resumed from a checkpoint trains on the token it would
have seen next.

Example::

    stream = TokenStream(source, encoder, seq_len=256, fraction=0.05, seed=0, rank=0, world=2)
    x, y = next(iter(stream))              # one block of rank 0's train segments
    state = stream.position(blocks=64)     # where block 64 starts: saved in the checkpoint
    stream.resume(state)                   # the next iteration starts there

Known limitations: the stream reads in the training process (data.num_workers must be 0); a resume re-reads (does
not re-tokenize) the text before its position, which for a hub stream means downloading it again; blocks come in
corpus order (no shuffle buffer).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from trainer.core.corpus import Segment, Source, split
from trainer.core.tokens import Encoder
from trainer.errors import DataError

# Segments tokenized per tokenizer call (a batch the tokenizers library spreads over the cores).
ENCODE_BATCH = 64
# Block starts remembered for `position`: the blocks a data loader can have fetched ahead of training.
REMEMBERED_BLOCKS = 1 << 14


@dataclass(frozen=True)
class Position:
    """Where a block starts: the epoch over the source, the index of the segment (in the source's order) whose
    tokens hold its first token, the offset of that token among them, and blocks still to skip from there."""

    epoch: int = 0
    segment: int = 0
    offset: int = 0
    skip: int = 0
    in_epoch: int = 0  # blocks of this epoch before it (the epoch's cap counts them)


def pack(pieces: Iterator[tuple[int, np.ndarray]], block: int) -> Iterator[tuple[np.ndarray, int, int]]:
    """(segment index, its tokens) → blocks of `block` tokens, each with the (segment, offset) of its first token."""
    parts: deque[list[Any]] = deque()  # [segment, tokens, consumed]
    avail = 0
    for k, ids in pieces:
        if len(ids) == 0:
            continue
        parts.append([k, ids, 0])
        avail += len(ids)
        while avail >= block:
            k0, off0 = parts[0][0], parts[0][2]
            out = np.empty(block, dtype=ids.dtype)
            filled = 0
            while filled < block:
                part = parts[0]
                take = min(block - filled, len(part[1]) - part[2])
                out[filled : filled + take] = part[1][part[2] : part[2] + take]
                part[2] += take
                filled += take
                if part[2] == len(part[1]):
                    parts.popleft()
            avail -= block
            yield out, k0, off0


def encoded(
    segments: Iterator[tuple[int, Segment, bool]], encoder: Encoder, start: tuple[int, int] = (0, 0)
) -> Iterator[tuple[int, np.ndarray]]:
    """(number, segment, first of its stream) → (number, tokens), a separator before each segment that opens a
    document unless it is its stream's first; the segment numbered `start[0]` loses its first `start[1]` tokens
    (a resume)."""
    for batch in iter(lambda: list(itertools.islice(segments, ENCODE_BATCH)), []):
        ids = encoder.encode([s.text for _, s, _ in batch])
        for (k, s, first), x in zip(batch, ids, strict=True):
            if s.opens and not first and len(encoder.sep_ids):
                x = np.concatenate([encoder.sep_ids, x])
            if k == start[0] and start[1]:
                x = x[start[1] :]
            yield k, x


class TokenStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Rank `rank` of `world`'s train blocks of `seq_len + 1` tokens, read from `source` without end (epoch after
    epoch), each epoch capped at `max_tokens / world` tokens when given."""

    def __init__(
        self,
        source: Source,
        encoder: Encoder,
        seq_len: int,
        fraction: float,
        seed: int,
        rank: int = 0,
        world: int = 1,
        max_tokens: int | None = None,
    ) -> None:
        self.source, self.encoder = source, encoder
        self.block = seq_len + 1
        self.fraction, self.seed = fraction, seed
        self.rank, self.world = rank, world
        self.max_blocks = None if max_tokens is None else max(1, max_tokens // world // self.block)
        self._start = Position()
        self._base = 0  # the number of the first block the next iteration yields
        self._starts: OrderedDict[int, Position] = OrderedDict()

    # ---- position ---------------------------------------------------------------------------------

    def resume(self, state: dict[str, int]) -> None:
        """Start the next iteration at a `position()` saved earlier (its `blocks` number included)."""
        self._base = int(state["blocks"])
        self._start = Position(**{k: int(state[k]) for k in ("epoch", "segment", "offset", "skip", "in_epoch")})
        self._starts.clear()

    def position(self, blocks: int) -> dict[str, int]:
        """Where block number `blocks` (counted from the run's start) starts, as a checkpointable dict."""
        if blocks in self._starts:
            at = self._starts[blocks]
        else:  # not yet fetched: the nearest earlier start, and the blocks from there to skip
            known = [b for b in self._starts if b <= blocks] or [self._base]
            b = max(known)
            at = self._starts.get(b, self._start)
            at = Position(at.epoch, at.segment, at.offset, at.skip + blocks - b, at.in_epoch)
        return {"blocks": blocks, **asdict(at)}

    def _remember(self, n: int, at: Position) -> None:
        self._starts[n] = at
        while len(self._starts) > REMEMBERED_BLOCKS:
            self._starts.popitem(last=False)

    # ---- blocks ------------------------------------------------------------------------------------

    def _mine(self, since: int) -> Iterator[tuple[int, Segment, bool]]:
        """This rank's train segments from number `since` on, numbered by their place in the source (held-out ones
        count too), each with whether it is the rank's first. Those before `since` are read, not tokenized."""
        train = 0
        for k, (s, held) in enumerate(split(self.source.segments(), self.fraction, self.seed)):
            if held:
                continue
            if train % self.world == self.rank and k >= since:
                yield k, s, train == self.rank
            train += 1

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = self._base
        at = self._start
        epoch, skip, count = at.epoch, at.skip, at.in_epoch
        start = (at.segment, at.offset)
        while True:
            for ids, k, off in pack(encoded(self._mine(start[0]), self.encoder, start), self.block):
                if self.max_blocks is not None and count >= self.max_blocks:
                    break
                count += 1
                if skip:
                    skip -= 1
                    continue
                self._remember(n, Position(epoch, k, off, in_epoch=count - 1))
                n += 1
                chunk = torch.from_numpy(ids.astype(np.int64))
                yield chunk[:-1], chunk[1:]
            if count == 0 and start == (0, 0):
                raise DataError(
                    f"corpus {self.source.label!r} gives rank {self.rank} of {self.world} no block of "
                    f"{self.block} tokens; add text, or lower seq_len or the number of devices"
                )
            epoch, start, count = epoch + 1, (0, 0), 0


class HeldOutBlocks(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The validation blocks of a streamed source: its first `count` held-out blocks, read once and kept."""

    def __init__(self, source: Source, encoder: Encoder, seq_len: int, fraction: float, seed: int, count: int) -> None:
        block = seq_len + 1
        numbered = enumerate(split(source.segments(), fraction, seed))
        held = ((k, s, i == 0) for i, (k, (s, _)) in enumerate((k, p) for k, p in numbered if p[1]))
        blocks = [ids for ids, _, _ in itertools.islice(pack(encoded(held, encoder), block), count)]
        self.blocks = np.stack(blocks) if blocks else np.empty((0, block), dtype=encoder.dtype)
        self.n_tokens = self.blocks.size

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = torch.from_numpy(self.blocks[i].astype(np.int64))
        return chunk[:-1], chunk[1:]
