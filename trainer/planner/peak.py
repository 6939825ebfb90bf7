"""The planner's pure half: what a profile holds, the peak model of a per-block plan, and its exact solver.

No torch here: a Profile is numbers, so the model and the solver are tested against brute force on synthetic
profiles (tests/test_planner.py) and reused on any profile, measured on real tensors or on fake ones.

The peak model follows the step as Lightning runs it: the forward runs with last step's gradients still alive
(`zero_grad` comes after `training_step`), the backward frees block i's kept bytes and creates its gradients
(with accumulation, micro-batches after the first run with every gradient alive), then the optimizer step.
The peak is the largest of: the forward of block i (fixed + what blocks before i keep + block i's forward peak),
the loss head, the backward of block i (fixed + what blocks up to i keep + block i's transient + the gradients of
the blocks after it), the embedding's backward and the optimizer step: block i's recompute coexists with what
blocks 0..i keep, not with everything, and the forward, where last step's gradients are still alive, is a phase of
its own. The solver is exact for this model: a dynamic programme over blocks whose state is (bytes kept in
forward, bytes kept to backward, bytes prefetched) of the blocks so far, keeping the fastest partial plan per
state; every constraint depends only on those sums, so nothing optimal is ever dropped.

Near tool: `torch.distributed._tools.sac_ilp` chooses per-module SAC as a mixed-integer programme (through PuLP) over
`SACEstimator`'s statistics; ours chooses a treatment per block (none, full, selective, op_sac, offload, ...) under a
whole-step peak model and solves it exactly with no solver dependency, so the plan it prints is the one the run
checks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from trainer.formatting import MIB

# Lightning's per-step scalars (the closure's loss / accum, logged values, norms) that a bare loop does not make:
# measured within ±1.2 KiB of the model on CPU runs; this is headroom for them.
BOOKKEEPING = 16 * 1024


# ----------------------------------------------------------------------------------------------------
# What the profile holds.
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cost:
    """One block under one treatment, measured. Bytes are live-tensor bytes on the training device."""

    kept_fwd: int  # what the block leaves alive at the end of its forward (input in, output out), weight copies in
    kept: int  # what it keeps until its backward: kept_fwd less the weight copies autocast lets go of
    fwd_peak: int  # its forward's peak (input, internals, output)
    transient: int  # extra bytes above `kept` at its backward's peak (recompute, grads in flight, new param grads)
    restored: int = 0  # offload: bytes brought back to the device in backward (prefetched during the next block's)
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0

    @property
    def ms(self) -> float:
        return self.fwd_ms + self.bwd_ms


@dataclass
class Profile:
    """Everything the peak model and the step-time model need, from one micro-batch."""

    treatments: tuple[str, ...]
    costs: list[dict[str, Cost]]  # per block
    block_grads: list[int]  # bytes of each block's parameter gradients
    params: int  # parameters and buffers
    grads: int  # every parameter gradient
    optimizer: int  # optimizer state
    x_bytes: int  # one residual-stream tensor (a block's input)
    # The rest of the model (embedding, loss head), live bytes of the segmented run (x0 and the head input held):
    embed_fwd_peak: int
    gap_fwd: int  # at the cut, going forward: what the embedding keeps + x0
    head_fwd_peak: int
    head_bwd_peak: int
    gap_bwd: int  # at the cut, going backward: + head gradients, the head input and its gradient
    embed_bwd_peak: int
    opt_peak: int  # absolute: training state + clipping + the optimizer step
    micro_batch: int
    seq_len: int
    accum: int
    precision: str
    device: str
    prefetch: bool = True
    untracked: int = 0  # CUDA: allocations the tracker cannot see (cuBLAS workspace, ...), held throughout
    extra: int = 0  # a re-plan's measured excess, added to every phase
    rest_ms: float = 0.0  # embedding + head, forward + backward
    opt_ms: float = 0.0  # clipping + optimizer step
    notes: list[str] = field(default_factory=list)
    loss: str = ""  # the loss head the embedding/head figures were measured with
    heads: dict[str, Profile] = field(default_factory=dict, repr=False)  # one Profile per loss head profiled

    @property
    def n_layer(self) -> int:
        return len(self.costs)

    def with_extra(self, extra: int) -> Profile:
        return replace(self, extra=extra)


# ----------------------------------------------------------------------------------------------------
# The peak model and the exact solver.
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Solution:
    treatments: tuple[str, ...]
    peak: int  # predicted whole-step peak, bytes
    step_ms: float  # predicted optimizer-step time
    where: str  # the phase that sets the peak


class PeakModel:
    """Predicted whole-step peak and step time of any per-block plan, from a Profile.

    Candidates (bytes), for treatments t_0..t_{L-1}, with kf/kb/fp/tr/rs a block's kept_fwd/kept/fwd_peak/
    transient/restored and g_j its gradients:
      forward, embedding      F + embed_fwd_peak
      forward, block i        F + gap_fwd - x + Σ_{j<i} kf_j + fp_i
      forward, head           F + head_fwd_peak - x + Σ_j kf_j
      backward, head          B + head_bwd_peak - x + Σ_j kb_j
      backward, block i       B + gap_bwd - 3x + Σ_{j≤i} kb_j + tr_i + rs_{i-1} (prefetch) + Σ_{j>i} g_j (accum 1)
      backward, embedding     B + embed_bwd_peak - x + Σ_j g_j (accum 1)
      optimizer step          opt_peak
    with F = params + optimizer + grads (last step's gradients live through the forward: Lightning zeroes them
    after `training_step`) and B = params + optimizer (+ every gradient when accumulating: later micro-batches run
    with them alive), each plus BOOKKEEPING. The segmented run holds x0 and the head input (and its gradient)
    itself; `- x` / `- 3x` take those out where the blocks count them.
    """

    def __init__(self, prof: Profile) -> None:
        self.prof = p = prof
        x = p.x_bytes
        base = p.params + p.optimizer + p.untracked + p.extra + BOOKKEEPING
        fwd = base + p.grads
        # Accumulating: later micro-batches run their backward with every gradient alive (the segmented run and
        # the blocks also count the gradients they create: with gradients present those are summed in place, so
        # this errs high by at most one block's gradients).
        bwd = base + (p.grads if p.accum > 1 else 0)
        self.c_embed_fwd = fwd + p.embed_fwd_peak
        self.c_fwd = fwd + p.gap_fwd - x
        self.c_head_fwd = fwd + p.head_fwd_peak - x
        self.c_head_bwd = bwd + p.head_bwd_peak - x
        self.c_bwd = bwd + p.gap_bwd - 3 * x
        self.c_embed_bwd = bwd + p.embed_bwd_peak - x + (sum(p.block_grads) if p.accum == 1 else 0)
        self.c_opt = p.opt_peak + p.untracked + p.extra + BOOKKEEPING
        L = p.n_layer
        self.after = [sum(p.block_grads[i + 1 :]) if p.accum == 1 else 0 for i in range(L)]
        self.constant = max(self.c_embed_fwd, self.c_embed_bwd, self.c_opt)
        self.fixed_ms = p.accum * p.rest_ms + p.opt_ms

    # -- evaluation (the definition; the solver must agree with it) ---------------------------------------------
    def candidates(self, treatments: Sequence[str]) -> list[tuple[int, str]]:
        p = self.prof
        if len(treatments) != p.n_layer:
            raise ValueError(f"{len(treatments)} treatments for {p.n_layer} blocks")
        out = [
            (self.c_embed_fwd, "forward, embedding"),
            (self.c_embed_bwd, "backward, embedding"),
            (self.c_opt, "optimizer step"),
        ]
        sf = sb = 0
        prev_restored = 0
        for i, t in enumerate(treatments):
            c = p.costs[i][t]
            out.append((self.c_fwd + sf + c.fwd_peak, f"forward, block {i}"))
            sf += c.kept_fwd
            sb += c.kept
            out.append((self.c_bwd + sb + c.transient + prev_restored + self.after[i], f"backward, block {i}"))
            prev_restored = c.restored if p.prefetch else 0
        out.append((self.c_head_fwd + sf, "forward, loss head"))
        out.append((self.c_head_bwd + sb, "backward, loss head"))
        return out

    def evaluate(self, treatments: Sequence[str]) -> Solution:
        peak, where = max(self.candidates(treatments), key=lambda c: c[0])
        return Solution(tuple(treatments), peak, self.step_ms(treatments), where)

    def step_ms(self, treatments: Sequence[str]) -> float:
        p = self.prof
        return self.fixed_ms + p.accum * sum(p.costs[i][t].ms for i, t in enumerate(treatments))

    # -- the exact solvers ---------------------------------------------------------------------------------------
    def solve(self, budget: int) -> Solution | None:
        """The plan of least predicted step time whose predicted peak is ≤ budget; None if none is.

        DP over blocks in order. State: (Σ kf, Σ kb, restored bytes of the previous block) of the blocks decided so
        far; every later constraint depends on the past only through these, so keeping the fastest partial plan per
        state is exact. Of plans equally fast, the one that leaves the most blocks under `none` wins (the profile
        holds a treatment's measured time at none's when the clock saw it faster: recompute is never free, so at a
        tie `none` is the faster in fact); remaining ties go to the earlier treatment in `treatments` order.
        """
        if self.constant > budget:
            return None
        best = self._dp(budget, objective="time")
        return None if best is None else self.evaluate(best)

    def min_peak(self) -> Solution:
        """The fastest plan of least predicted peak; exact: the least peak by the same DP on the running maximum,
        then the fastest plan within it."""
        best = self._dp(None, objective="peak")
        assert best is not None
        least = self.evaluate(best).peak
        fastest = self.solve(least)
        assert fastest is not None and fastest.peak == least
        return fastest

    def _dp(self, budget: int | None, objective: str) -> tuple[str, ...] | None:
        """Blocks in order; state (Σ kf, Σ kb, prefetched bytes) → (best score, back-pointer). Ties keep the first
        partial plan found (states and treatments are visited in a fixed order, so the answer is reproducible)."""
        p = self.prof
        prefetch = p.prefetch
        # score: see _zero
        states: dict[tuple[int, int, int], tuple[Any, Any]] = {(0, 0, 0): (_zero(objective), None)}
        for i in range(p.n_layer):
            costs = [(t, p.costs[i][t]) for t in p.treatments]
            after = self.after[i]
            nxt: dict[tuple[int, int, int], tuple[Any, Any]] = {}
            for (sf, sb, prev), (score, path) in states.items():
                for t, c in costs:
                    fwd = self.c_fwd + sf + c.fwd_peak
                    nsb = sb + c.kept
                    bwd = self.c_bwd + nsb + c.transient + prev + after
                    if budget is not None and (fwd > budget or bwd > budget):
                        continue
                    key = (sf + c.kept_fwd, nsb, c.restored if prefetch else 0)
                    extra = t != "none"  # blocks that recompute or move: the tie-break
                    if objective == "time":
                        nscore: Any = (score[0] + c.ms, score[1] + extra)
                    else:
                        nscore = (max(score[0], fwd, bwd), score[1] + c.ms, score[2] + extra)
                    old = nxt.get(key)
                    if old is None or nscore < old[0]:
                        nxt[key] = (nscore, (path, t))
            states = _pareto(nxt)
            if not states:
                return None
        best: tuple[Any, Any] | None = None
        for (sf, sb, _), (score, path) in states.items():
            head = max(self.c_head_fwd + sf, self.c_head_bwd + sb)
            if budget is not None and head > budget:
                continue
            if objective == "peak":
                score = (max(score[0], head, self.constant), *score[1:])
            if best is None or score < best[0]:
                best = (score, path)
        if best is None:
            return None
        out: list[str] = []
        path = best[1]
        while path is not None:
            path, t = path
            out.append(t)
        return tuple(reversed(out))

    def brute_force(self, budget: int) -> Solution | None:
        """Every plan, evaluated: the reference the tests hold `solve` to (|treatments|^L plans)."""
        best: Solution | None = None
        for combo in itertools.product(self.prof.treatments, repeat=self.prof.n_layer):
            s = self.evaluate(combo)
            if s.peak <= budget and (best is None or s.step_ms < best.step_ms):
                best = s
        return best


def _pareto(states: dict[tuple[int, int, int], tuple[Any, Any]]) -> dict[tuple[int, int, int], tuple[Any, Any]]:
    """Drop dominated partial plans: another keeps no more bytes in forward, to backward and in prefetch, and scores
    no worse. Every later constraint and cost is monotone in those, so nothing optimal is lost (exact)."""
    if len(states) < 64:
        return states
    order = sorted(states.items(), key=lambda kv: (kv[1][0], kv[0]))  # best score first
    kept: dict[tuple[int, int, int], tuple[Any, Any]] = {}
    # staircase per prefetch value: (sf, sb) pairs of kept states; a new state is dominated if some kept one (of no
    # larger prefetch and, by the order, no worse score) has sf' <= sf and sb' <= sb
    stairs: dict[int, list[tuple[int, int]]] = {}
    for key, value in order:
        sf, sb, prev = key
        dominated = False
        for pv, pts in stairs.items():
            if pv <= prev and any(a <= sf and b <= sb for a, b in pts):
                dominated = True
                break
        if dominated:
            continue
        kept[key] = value
        stairs.setdefault(prev, []).append((sf, sb))
    return kept


def _zero(objective: str) -> Any:
    """(time, blocks not under none) or (running peak, time, blocks not under none): compared in that order."""
    return (0.0, 0) if objective == "time" else (0, 0.0, 0)


def affine_profile(big: Profile, small: Profile, micro_batch: int) -> Profile:
    """Every byte figure at another micro-batch size, from two measured sizes (each tensor is ∝ batch or fixed)."""
    b1, b2 = big.micro_batch, small.micro_batch

    def at(v1: int, v2: int) -> int:
        return max(0, round(v1 + (v1 - v2) * (micro_batch - b1) / (b1 - b2)))

    costs = [
        {
            t: Cost(
                kept_fwd=at(c1.kept_fwd, c2.kept_fwd),
                kept=at(c1.kept, c2.kept),
                fwd_peak=at(c1.fwd_peak, c2.fwd_peak),
                transient=at(c1.transient, c2.transient),
                restored=at(c1.restored, c2.restored),
            )
            for t, c1 in d1.items()
            for c2 in [d2[t]]
        }
        for d1, d2 in zip(big.costs, small.costs, strict=True)
    ]
    fields_ = ("x_bytes", "embed_fwd_peak", "gap_fwd", "head_fwd_peak", "head_bwd_peak", "gap_bwd", "embed_bwd_peak")
    return replace(
        big,
        costs=costs,
        micro_batch=micro_batch,
        opt_peak=big.opt_peak,
        **{f: at(getattr(big, f), getattr(small, f)) for f in fields_},
    )


def smallest_budget_mib(peak: int) -> float:
    """A budget in MiB, rounded up (3 decimals below 10 MiB, 1 above), that a plan of this peak fits."""
    digits = 3 if peak < 10 * MIB else 1
    return math.ceil(peak / MIB * 10**digits) / 10**digits


def largest_micro_batch(prof: Profile, small: Profile | None, budget: int) -> int | None:
    if small is None or small.micro_batch == prof.micro_batch:
        return None
    for b in range(prof.micro_batch - 1, 0, -1):
        if PeakModel(affine_profile(prof, small, b)).min_peak().peak <= budget:
            return b
    return None
