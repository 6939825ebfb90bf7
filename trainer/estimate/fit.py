"""Where a configuration fits: for each GPU of the catalogue and each policy, the smallest FSDP2 world size at which
one rank's whole-step peak fits in the GPU's memory less the reserve (trainer/measure/gpus.py).

Why a few estimates answer every world size: under FSDP2 a rank holds its shard of each parameter (the first
ceil(rows / world) rows, torch.chunk's split), the gradients and AdamW state of that shard, and, at every world
size alike, the activations, the all-gather buffers of the layers being computed and the head. So at any moment
of the step the live bytes are `U + k·x(world)`, x the rank's parameter-shard bytes, and the step's peak is the
largest of these lines. An estimate at one world size gives the line that peaks there (k from the peak's sharded
parts: the parameters' shards, their gradients, AdamW's state and its temporaries). Two world sizes bound every
size between them: below by the larger of their lines (each is a real moment of the step), above by the chord
between them (the peak is convex in x, as a maximum of lines). Where the bounds disagree about a cell, that world
size is estimated directly and the bounds tighten. At a world size that does not divide a parameter's rows FSDP2
pads it, so the all-gather buffers hold a little more: the upper bound adds all of the padding; and a cell within
`MARGIN` of its boundary is estimated directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from trainer.core import step as step_
from trainer.core.schema import Config
from trainer.estimate.session import Estimate, Session, open_session
from trainer.estimate.tables import estimate_all
from trainer.measure.gpus import Gpu, Reserve
from trainer.policies import Plan

MARGIN = 1e-4  # a bound this close to a capacity is not trusted (rounding): estimate that world size
SHARDED = (step_.PARAMETERS, step_.OPTIMIZER_STATE, step_.LAST_GRADIENTS, step_.GRADIENTS, step_.OPTIMIZER)


def at_world(config: Config, world: int) -> Config:
    """The configuration on `world` ranks of FSDP2 (one node), or on one device without sharding."""
    t = config.trainer
    if world == 1:
        single = t.strategy if t.strategy not in ("fsdp", "fsdp2", "ddp") else "auto"
        return replace(config, trainer=replace(t, strategy=single, devices=1, num_nodes=1))
    return replace(config, trainer=replace(t, strategy="fsdp2", devices=world, num_nodes=1))


def shard_unit(shapes: Sequence[tuple[tuple[int, ...], int]], world: int) -> int:
    """Bytes of rank 0's parameter shards at `world` (torch.chunk's split of dim 0: rank 0 has the largest)."""
    total = 0
    for shape, itemsize in shapes:
        rows = shape[0] if shape else 1
        numel = math.prod(shape) if shape else 1
        total += -(-rows // world) * (numel // max(rows, 1)) * itemsize
    return total


def shard_padding(shapes: Sequence[tuple[tuple[int, ...], int]], world: int) -> int:
    """The rows FSDP2 pads every parameter with to split it evenly, in bytes: what its all-gather buffers hold
    beyond the parameters at a world size that does not divide them (at most all of them at once)."""
    padded = 0
    for shape, itemsize in shapes:
        rows = shape[0] if shape else 1
        numel = math.prod(shape) if shape else 1
        padded += (-(-rows // world) * world - rows) * (numel // max(rows, 1)) * itemsize
    return padded


@dataclass(frozen=True)
class Line:
    """The live bytes of the moment that set the peak of an estimate at `world`, as a function of the shard bytes."""

    world: int
    peak: int
    sharded: int  # the peak's bytes that shard with the world size
    unit: int  # the shard bytes at `world`

    def at(self, x: float) -> float:
        return self.peak - self.sharded + self.sharded * x / self.unit

    @classmethod
    def of(cls, est: Estimate, world: int, unit: int) -> Line:
        buffers = est.components.get("buffers", 0)  # counted under "parameters", never sharded
        sharded = sum(est.at_step_peak.get(label, 0) for label in SHARDED) - buffers
        return cls(world, est.peak_bytes, max(0, sharded), unit)


@dataclass
class WorldCurve:
    """One policy's per-rank peak over world sizes: the estimates made so far and the bounds they give."""

    single: int | None = None  # the peak on one device, unsharded (world 1)
    lines: dict[int, Line] = field(default_factory=dict)
    refusal: str = ""  # the policy cannot run this model: why

    def bounds(self, world: int, x: float, padding: float = 0.0) -> tuple[float, float]:
        """Below: the largest line (padding only adds). Above: the chord between the estimates either side, plus
        every parameter's padding at this world size."""
        if world in self.lines:
            p = self.lines[world].peak
            return p, p
        low = max(line.at(x) for line in self.lines.values())
        points = sorted((line.unit, line.peak) for line in self.lines.values())  # x grows as the world shrinks
        below = [(u, p) for u, p in points if u <= x]
        above = [(u, p) for u, p in points if u >= x]
        if not below or not above:  # outside the estimated world sizes: no chord; the line is all there is
            return low, math.inf
        (x0, p0), (x1, p1) = below[-1], above[0]
        high = p0 if x1 == x0 else p0 + (p1 - p0) * (x - x0) / (x1 - x0)
        return low, max(low, high + padding)


@dataclass(frozen=True)
class FitCell:
    gpu: str
    memory_bytes: int
    usable_bytes: int
    policy: str
    loss: str
    world_size: int | None  # None: does not fit at any world size up to the table's largest
    per_rank_peak_bytes: int | None  # at world_size: estimated, or (peak_is_bound) at most this
    estimated: bool  # world_size (and world_size − 1) estimated directly, or decided by bounds well clear of it
    peak_is_bound: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "memory_bytes": self.memory_bytes,
            "usable_bytes": self.usable_bytes,
            "policy": self.policy,
            "loss": self.loss,
            "world_size": self.world_size,
            "per_rank_peak_bytes": self.per_rank_peak_bytes,
            "peak_is_bound": self.peak_is_bound,
        }


@dataclass
class FitTable:
    cells: list[FitCell]
    max_world: int
    reserve: Reserve
    worlds_estimated: list[int]
    refusals: dict[str, str]
    loss: str
    # The estimates made, by world size then policy, and how to make more (a cell's own world size, for its time)
    estimates: dict[int, dict[str, Estimate | str]] = field(default_factory=dict, repr=False)
    more: Callable[[int, list[str]], dict[str, Estimate | str]] | None = field(default=None, repr=False, compare=False)

    def estimate_at(self, world: int, names: list[str]) -> dict[str, Estimate]:
        """The policies' estimates at `world`, made now where the table did not need them."""
        have = self.estimates.get(world, {})
        missing = [n for n in names if n not in have]
        if missing and self.more is not None:
            have = {**have, **self.more(world, missing)}
        return {n: e for n in names if isinstance(e := have.get(n), Estimate)}

    def to_json(self) -> list[dict[str, Any]]:
        return [c.to_json() for c in self.cells]


class WorldEstimates:
    """Estimates of the wanted policies at a world size, one session per world size; `known` ones are not redone
    and `session` (the caller's, at its own world size) is reused."""

    def __init__(
        self,
        config: Config,
        device: str,
        plans: dict[str, Plan],
        workers: int,
        session: Session | None,
        known: dict[int, dict[str, Estimate | str]],
    ) -> None:
        self.config, self.device, self.plans, self.workers = config, device, plans, workers
        self.session = session
        self.known = {w: dict(by_name) for w, by_name in known.items()}  # grows; the caller's stays as given
        self.shapes: list[tuple[tuple[int, ...], int]] = []
        self.estimated: list[int] = []

    def measure(self, world: int, names: list[str]) -> dict[str, Estimate | str]:
        self.estimated.append(world)
        own = self.session if self.session is not None and self.session.world == world else None
        if own is not None and not self.shapes and world == 1:
            self.shapes = _shapes(own)
        known = self.known.get(world, {})
        if all(n in known for n in names) and (self.shapes or world != 1):
            return {n: known[n] for n in names}
        session = own or open_session(at_world(self.config, world), self.device)
        try:
            if not self.shapes and world == 1:
                self.shapes = _shapes(session)
            todo = [n for n in names if n not in known]
            made = estimate_all(
                session.config, session.device, self.plans, session=session, workers=self.workers, only=todo
            )
        finally:
            if own is None:
                session.close()
        self.known.setdefault(world, {}).update(made)  # kept: the fit table's times reuse them
        return {n: self.known[world][n] for n in names}


def _shapes(session: Session) -> list[tuple[tuple[int, ...], int]]:
    return [(tuple(p.shape), p.element_size()) for p in session.module.parameters()]


def _decide(
    curve: WorldCurve, usable: int, max_world: int, unit: Callable[[int], tuple[int, int]]
) -> tuple[int | None, list[int]]:
    """The smallest world size that fits, or the world sizes still to estimate before it is known."""
    if curve.single is not None and curve.single <= usable:
        return 1, []
    unsure: list[int] = []
    for w in range(2, max_world + 1):
        low, high = curve.bounds(w, *unit(w))
        exact = w in curve.lines
        if exact and low <= usable or not exact and high * (1 + MARGIN) <= usable:
            return (w, []) if not unsure else (None, unsure)
        if exact or low * (1 - MARGIN) > usable:
            continue
        unsure.append(w)
    return None, unsure


def fit_table(
    config: Config,
    device: str,
    gpus: Sequence[Gpu],
    reserve: Reserve,
    names: list[str],
    plans: dict[str, Plan] | None = None,
    max_world: int = 64,
    workers: int = 1,
    session: Session | None = None,
    known: dict[int, dict[str, Estimate | str]] | None = None,
    rounds: int = 3,
) -> FitTable:
    """The fit table: `names` (policies, with the configured head) × `gpus`. Estimates at world 1, 2 and
    `max_world`, then at the world sizes the bounds leave open (at most `rounds` more rounds). `session`: one
    already open for `config`, reused on one device and closed if sharded (its process group is needed for the
    other world sizes); `known`: estimates already made, by world size."""
    worlds = WorldEstimates(config, device, plans or {}, workers, session and session.release_group(), known or {})
    curves = {n: WorldCurve() for n in names}
    usable = {g.name: reserve.usable(g.memory_bytes) for g in gpus}
    _record(curves, worlds, 1, names)
    sharded = [n for n, c in curves.items() if not c.refusal and (c.single is None or c.single > min(usable.values()))]
    for w in sorted({2, max_world}) if sharded else ():  # only what one device cannot hold
        _record(curves, worlds, w, sharded)
    unit = _units(worlds)
    for _ in range(rounds):
        wanted: dict[int, set[str]] = {}
        for name, curve in curves.items():
            if curve.refusal:
                continue
            for g in gpus:
                _, unsure = _decide(curve, usable[g.name], max_world, unit)
                if unsure:
                    wanted.setdefault(_next_world(unsure), set()).add(name)
        if not wanted:
            break
        for w, which in sorted(wanted.items()):
            _record(curves, worlds, w, sorted(which))
    cells = [_cell(g, usable[g.name], n, curves[n], config.loss.name, max_world, unit) for g in gpus for n in names]
    refusals = {n: c.refusal for n, c in curves.items() if c.refusal}
    estimated = sorted(set(worlds.estimated))
    return FitTable(cells, max_world, reserve, estimated, refusals, config.loss.name, worlds.known, worlds.measure)


def _next_world(unsure: list[int]) -> int:
    """The world size to estimate next among those the bounds leave open: a power of two where one lies among
    them (many cells and policies then share the estimate, and it has no padding), else the smallest."""
    powers = [w for w in unsure if w & (w - 1) == 0]
    return powers[0] if powers else unsure[0]


def _record(curves: dict[str, WorldCurve], worlds: WorldEstimates, world: int, names: list[str]) -> None:
    out = worlds.measure(world, [n for n in names if not curves[n].refusal])
    for name, est in out.items():
        curve = curves[name]
        if isinstance(est, str):
            curve.refusal = est
        elif world == 1:
            curve.single = est.peak_bytes
        else:
            curve.lines[world] = Line.of(est, world, shard_unit(worlds.shapes, world))


def _units(worlds: WorldEstimates) -> Callable[[int], tuple[int, int]]:
    """A world size's shard bytes and padding bytes."""
    cache: dict[int, tuple[int, int]] = {}

    def unit(w: int) -> tuple[int, int]:
        if w not in cache:
            cache[w] = (shard_unit(worlds.shapes, w), shard_padding(worlds.shapes, w))
        return cache[w]

    return unit


def _cell(
    gpu: Gpu,
    usable: int,
    name: str,
    curve: WorldCurve,
    loss: str,
    max_world: int,
    unit: Callable[[int], tuple[int, int]],
) -> FitCell:
    base = dict(gpu=gpu.name, memory_bytes=gpu.memory_bytes, usable_bytes=usable, policy=name, loss=loss)
    if curve.refusal:
        return FitCell(**base, world_size=None, per_rank_peak_bytes=None, estimated=True)
    world, unsure = _decide(curve, usable, max_world, unit)
    if world is None and unsure:  # rounds ran out: the smallest world size the upper bound proves
        world = next((w for w in range(unsure[0], max_world + 1) if curve.bounds(w, *unit(w))[1] <= usable), None)
    if world is None:
        return FitCell(**base, world_size=None, per_rank_peak_bytes=None, estimated=not unsure)
    if world == 1:
        return FitCell(**base, world_size=1, per_rank_peak_bytes=curve.single, estimated=True)
    _, high = curve.bounds(world, *unit(world))  # exact where estimated, else the bound that proved the fit
    return FitCell(
        **base,
        world_size=world,
        per_rank_peak_bytes=int(high),
        estimated=not unsure,
        peak_is_bound=world not in curve.lines,
    )


__all__ = ["MARGIN", "WorldCurve", "FitCell", "FitTable", "Line", "at_world", "fit_table", "shard_unit"]
