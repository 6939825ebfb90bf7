"""What CUDA's caching allocator reserves for a step's tensors: the step's allocations and frees, replayed through a
model of torch's `CUDACachingAllocator` (its default configuration), so an estimate on fake tensors can be set
beside `torch.cuda.max_memory_reserved()` — the figure trainers print (torchtitan's `reserved_bytes.all.peak`).

Why a replay, not a margin: what the allocator holds beyond the live tensors is fragmentation, and that depends on
the order and sizes of what the step allocates. The allocator keeps every segment it took from the driver (nothing
is returned without `empty_cache` or an out-of-memory retry), so its reserved peak is the most segment bytes ever
held. The rules modelled, as torch's allocator applies them with no `PYTORCH_CUDA_ALLOC_CONF`:

- every request rounds up to a multiple of 512 bytes; requests up to 1 MiB come from the small pool, larger ones
  from the large pool;
- a request takes the smallest free block of its pool that holds it (best fit); a block larger by at least 512
  bytes (small pool) or more than 1 MiB (large pool) is split, the rest staying free;
- with no free block big enough, a new segment: 2 MiB for a small request, 20 MiB for a large one under 10 MiB,
  else the request rounded up to 2 MiB;
- a freed block merges with free neighbours of its segment; segments are kept.

Not modelled (say so beside the figure): one stream only — FSDP2 all-gathers and reduce-scatters on streams of
their own, whose cached blocks the compute stream cannot reuse, so a real run reserves somewhat more; expandable
segments and `max_split_size_mb` (off by default); the CUDA context, cuBLAS workspaces and NCCL's buffers, which
`max_memory_reserved` does not count either.

The steady state: the step is replayed twice. Storages alive before the step and freed inside it (last step's
gradients) are, in the second pass, the blocks of the same size that the first pass left alive (this step's
gradients), so the second pass starts from the segments a previous step left, as in a long run.

Near tool: none in torch models the allocator; `torch.cuda.memory_stats` and `memory._snapshot()` report the real one
on a real GPU, which is what this replay is held against when a GPU is lent.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

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
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            block = self._by_key[pool[i]]
            self._remove(block, small)
        else:
            seg = segment_size(size)
            self.segments += 1
            block = _Block(self.segments, 0, seg, small)
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            tail = _Block(block.segment, block.offset + size, rest, small, True, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._insert(tail, small)
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block) -> None:
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


@dataclass(frozen=True)
class Reserved:
    """The replay's figures, in bytes: the allocator's peaks over the step (its second pass)."""

    peak_reserved: int
    peak_allocated: int


def replay(events: Sequence[tuple[int, int]], adopted: Iterable[int]) -> Reserved:
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

    alloc = CachingAllocator()
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
