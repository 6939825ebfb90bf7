"""What CUDA's caching allocator reserves for a step's tensors: the step's allocations and frees, replayed through a
model of torch's `CUDACachingAllocator` (its default configuration, or `expandable_segments:True`: see
`ExpandableSegments` and `AllocatorConf`), so an estimate on fake tensors can be set beside
`torch.cuda.max_memory_reserved()`, the figure trainers print (torchtitan's `reserved_bytes.all.peak`).

Why a replay, not a margin: what the allocator holds beyond the live tensors is fragmentation, and that depends on
the order and sizes of what the step allocates. The allocator keeps every segment it took from the driver (nothing
is returned without `empty_cache` or an out-of-memory retry), so its reserved peak is the most segment bytes ever
held. The rules modelled for the default mode, as torch's allocator applies them with no `PYTORCH_CUDA_ALLOC_CONF`:

- every request rounds up to a multiple of 512 bytes; requests up to 1 MiB come from the small pool, larger ones
  from the large pool;
- a request takes the smallest free block of its pool that holds it (best fit); a block larger by at least 512
  bytes (small pool) or more than 1 MiB (large pool) is split, the rest staying free;
- with no free block big enough, a new segment: 2 MiB for a small request, 20 MiB for a large one under 10 MiB,
  else the request rounded up to 2 MiB;
- a freed block merges with free neighbours of its segment; segments are kept.

Not modelled (say so beside the figure): one stream only — FSDP2 all-gathers and reduce-scatters on streams of
their own, whose cached blocks the compute stream cannot reuse (each stream has its own segments, expandable ones
too), so a real run reserves somewhat more; `max_split_size_mb` and the other keys `AllocatorConf` names as not
modelled; the CUDA context, cuBLAS workspaces and NCCL's buffers, which
`max_memory_reserved` does not count either.

The steady state: the step is replayed twice. Storages alive before the step and freed inside it (last step's
gradients) are, in the second pass, the blocks of the same size that the first pass left alive (this step's
gradients), so the second pass starts from the segments a previous step left, as in a long run.

Near tool: none in torch models the allocator; `torch.cuda.memory_stats` and `memory._snapshot()` report the real one
on a real GPU, which is what this replay is held against when a GPU is lent.
"""

from __future__ import annotations

import bisect
import math
import os
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from trainer.errors import ConfigError

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20  # requests up to 1 MiB: the small pool
SMALL_BUFFER = 2 << 20  # a small pool's segment
LARGE_BUFFER = 20 << 20  # a segment for a large request under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(size: int) -> int:
    return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * -(-size // MIN_BLOCK)


def segment_size(size: int) -> int:
    """What the allocator asks the driver for when no cached block holds a request of `size` (rounded) bytes."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    small: bool  # its segment's pool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None


@dataclass
class CachingAllocator:
    """The model: pools of free blocks by size, segments never released. `reserved` and `allocated` are the
    allocator's own counters (rounded sizes); their peaks are `max_memory_reserved` / `max_memory_allocated`."""

    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    peak_allocated: int = 0
    segments: int = 0
    _free: dict[bool, list[tuple[int, int, int]]] = field(default_factory=lambda: {True: [], False: []})
    _by_key: dict[tuple[int, int, int], _Block] = field(default_factory=dict)
    _next_id: int = 0

    def _key(self, b: _Block) -> tuple[int, int, int]:
        return (b.size, b.segment, b.offset)

    def _insert(self, b: _Block, small: bool) -> None:
        key = self._key(b)
        bisect.insort(self._free[small], key)
        self._by_key[key] = b

    def _remove(self, b: _Block, small: bool) -> None:
        key = self._key(b)
        pool = self._free[small]
        del pool[bisect.bisect_left(pool, key)]
        del self._by_key[key]

    def malloc(self, nbytes: int) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._cached(size, small)
        if block is None:
            block = self._from_driver(size, small)
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = block.size - size
        if self._splits(rest, small):
            tail = _Block(block.segment, block.offset + size, rest, small, True, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._insert(tail, small)
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def _cached(self, size: int, small: bool) -> _Block | None:
        """get_free_block: the smallest free block of the pool that holds `size` (best fit), taken out of it."""
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i == len(pool):
            return None
        block = self._by_key[pool[i]]
        self._remove(block, small)
        return block

    def _from_driver(self, size: int, small: bool) -> _Block:
        """alloc_block: a new segment of `segment_size`, counted as reserved."""
        seg = segment_size(size)
        self.segments += 1
        self.reserved += seg
        return _Block(self.segments, 0, seg, small)

    def _splits(self, rest: int, small: bool) -> bool:
        """should_split: a small block's rest of 512 bytes or more, a large block's of more than 1 MiB."""
        return rest >= MIN_BLOCK if small else rest > SMALL_SIZE

    def free(self, block: _Block) -> _Block:
        """Free `block`, merged with its free neighbours; the merged free block."""
        small = block.small
        block.free = True
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(neighbour, small)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._insert(block, small)
        return block


@dataclass
class ExpandableSegments(CachingAllocator):
    """The model under `expandable_segments:True`: one segment per pool (per stream: one stream here) that grows at
    its end in pages, 2 MiB for the small pool and 20 MiB for the large one, instead of a new segment per miss.

    The rules, from torch's c10/cuda/CUDACachingAllocator.cpp (v2.6.0 line numbers; unchanged in later releases
    where noted in the docs):

    - best fit among the mapped free blocks, where a free block just below the unmapped rest of the segment counts
      as itself plus that rest, so any other free block that holds the request is taken first (get_free_block,
      L2570-2588, `expandable_size`);
    - with none, the segment grows: if its last mapped block is free, by the pages the request lacks beyond it,
      merged with it; else by the pages the whole request needs (find_expandable_block L2239-2293,
      try_allocate_expandable_block L2363-2394, map_block L2295-2361: whole pages, `ExpandableSegment::map`);
    - every rest of 512 bytes or more is split off, in both pools (should_split L2540-2548);
    - frees merge with free neighbours as in the default mode; nothing is unmapped without `empty_cache` or an
      out-of-memory retry (unmap_block is reached only from release_cached_blocks, L2859-2905), and reserved counts
      the mapped pages (map_block L2337-2341).
    """

    _last: dict[bool, _Block | None] = field(default_factory=lambda: {True: None, False: None})

    def _cached(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i == len(pool):
            return None
        while i + 1 < len(pool) and self._expandable(pool[i + 1]) < self._expandable(pool[i]):
            i += 1
        block = self._by_key[pool[i]]
        self._remove(block, small)
        return block

    def _expandable(self, key: tuple[int, int, int]) -> float:
        block = self._by_key[key]
        return math.inf if block.next is None else block.size  # the last mapped block: the segment's rest too

    def _from_driver(self, size: int, small: bool) -> _Block:
        page = SMALL_BUFFER if small else LARGE_BUFFER
        last = self._last[small]
        if last is not None and last.free:
            self._remove(last, small)
            grow = page * -(-(size - last.size) // page)
            last.size += grow
            block = last
        else:
            grow = page * -(-size // page)
            offset = 0 if last is None else last.offset + last.size
            block = _Block(1 if small else 2, offset, grow, small, True, last, None)
            if last is not None:
                last.next = block
        self.reserved += grow
        self._last[small] = block
        return block

    def _splits(self, rest: int, small: bool) -> bool:
        return rest >= MIN_BLOCK

    def malloc(self, nbytes: int) -> _Block:
        block = super().malloc(nbytes)
        if block.next is not None and block.next.next is None:  # the last block split: its rest is now last
            self._last[block.small] = block.next
        return block

    def free(self, block: _Block) -> _Block:
        merged = super().free(block)
        if merged.next is None:
            self._last[merged.small] = merged
        return merged


@dataclass(frozen=True)
class Reserved:
    """The replay's figures, in bytes: the allocator's peaks over the step (its second pass)."""

    peak_reserved: int
    peak_allocated: int


# PYTORCH_CUDA_ALLOC_CONF's keys (c10/core/AllocatorConfig.h, c10/cuda/CUDAAllocatorConfig.h) that the replay does
# not model: set, they are named beside the figure
UNMODELLED_KEYS = (
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "large_segment_size_mb",
    "backend",
)
# The keys that change nothing the device's reserved figure counts (host pinned memory, locking, a cap that matters
# only at an out-of-memory, graph capture): accepted and left aside
NO_EFFECT_KEYS = (
    "per_process_memory_fraction",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_use_cuda_host_register",
    "pinned_reserve_segment_size_mb",
    "release_lock_on_cudamalloc",
    "graph_capture_record_stream_reuse",
    "throw_on_cudamalloc_oom",
)
ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the first set wins, as torch 2.13 reads them


@dataclass(frozen=True)
class AllocatorConf:
    """The caching allocator's settings, as torch reads them from `PYTORCH_CUDA_ALLOC_CONF` (else
    `PYTORCH_ALLOC_CONF`): comma-separated `key:value` pairs. The replay models `expandable_segments`; the keys it
    does not model are kept to be named."""

    expandable_segments: bool = False
    unmodelled: tuple[str, ...] = ()
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> AllocatorConf:
        """'expandable_segments:True,max_split_size_mb:128'; torch's spelling (True/False, capitalised)."""
        expandable, unmodelled = False, []
        for pair in filter(None, (p.strip() for p in re.split(r",(?![^\[]*\])", text))):
            key, sep, value = (x.strip() for x in pair.partition(":"))
            if not sep or not value:
                raise ValueError(f"allocator setting {pair!r}: write key:value, such as expandable_segments:True")
            if key == "expandable_segments":
                if value not in ("True", "False"):
                    raise ValueError(f"expandable_segments:{value}: write True or False, as torch expects")
                expandable = value == "True"
            elif key in UNMODELLED_KEYS:
                if not (key == "backend" and value == "native"):
                    unmodelled.append(f"{key}:{value}")
            elif key not in NO_EFFECT_KEYS:
                known = ", ".join(("expandable_segments", *UNMODELLED_KEYS, *NO_EFFECT_KEYS))
                raise ValueError(f"allocator setting {key!r} is not one of torch's: {known}")
        return cls(expandable, tuple(unmodelled), text)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AllocatorConf:
        """The setting a run in this environment gets; one that torch would refuse is one line naming the variable."""
        environ = os.environ if environ is None else environ
        for var in ENV_VARS:
            if var in environ:
                try:
                    return cls.parse(environ[var])
                except ValueError as e:
                    raise ConfigError(f"{var}={environ[var]!r}: {e}") from None
        return cls()

    def describe(self) -> str:
        mode = "expandable segments" if self.expandable_segments else "the default (no expandable segments)"
        left = f"; not modelled: {', '.join(self.unmodelled)}" if self.unmodelled else ""
        return f"caching allocator: {mode}{left}"


def replay(events: Sequence[tuple[int, int]], adopted: Iterable[int], conf: AllocatorConf | None = None) -> Reserved:
    """Replay a tracked step (the live-tensor tracker's (record, signed byte delta) events; `adopted`: the records
    that existed before it) through the caching allocator, twice, and return the second pass's peaks."""
    adopted = set(adopted)
    sizes: dict[int, int] = defaultdict(int)
    for record, delta in events:
        sizes[record] += delta
    final = {r: n for r, n in sizes.items() if n > 0}
    sizes_at_adopt: dict[int, int] = {}
    for record, delta in events:
        if record in adopted and record not in sizes_at_adopt:
            sizes_at_adopt[record] = delta
    carried_in = {r for r in adopted if r not in final}  # freed inside the step (last step's gradients)
    carried_out = [r for r in final if r not in adopted]  # made inside it and alive at its end (this step's)

    alloc = ExpandableSegments() if conf is not None and conf.expandable_segments else CachingAllocator()
    blocks: dict[int, _Block] = {}
    current: dict[int, int] = defaultdict(int)
    kept: dict[int, list[_Block]] = defaultdict(list)  # the first pass's carried-out blocks, by size

    def run(first: bool) -> None:
        current.clear()
        for record, delta in events:
            before = current[record]
            after = before + delta
            current[record] = after
            if not first and record in adopted and before == 0:
                if record not in carried_in:
                    continue  # a parameter or optimizer state: its block from the first pass stays
                if kept[after]:  # last step's storage of this size: the block the previous pass left
                    blocks[record] = kept[after].pop(0)
                    continue
            if before > 0:
                alloc.free(blocks.pop(record))
            if after > 0:
                blocks[record] = alloc.malloc(after)

    run(first=True)
    for r in carried_out:
        kept[final[r]].append(blocks.pop(r))
    # What no storage of the next step takes up (a logged loss, say) is freed before it: small, and freed early in
    # a real step too.
    bound = {size: len(bs) for size, bs in kept.items()}
    for r in carried_in:
        n = sizes_at_adopt.get(r, 0)
        if bound.get(n, 0) > 0:
            bound[n] -= 1
    for size, left in bound.items():
        for _ in range(left):
            alloc.free(kept[size].pop(0))
    alloc.peak_reserved, alloc.peak_allocated = alloc.reserved, alloc.allocated
    run(first=False)
    return Reserved(alloc.peak_reserved, alloc.peak_allocated)
