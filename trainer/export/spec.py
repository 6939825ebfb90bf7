"""What an export is made of: the plan as elements, what a target can write (a `Candidate`), how faithful each element
is (a `Row`), and `Target`, the base every target's class extends, with the registry (the one list of targets).

A target says three things about our plan: which plans it can write for this model (`candidates`, each with its
settings in the target's own form and the plan that measures it here), how it runs a treatment it does run
(`fidelity`, `similar`), and why it cannot run an element at all (`why_not`). The rest (choosing the closest plan,
the rows, the figures) is the same for every target, in fidelity.py.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from trainer.core.schema import Config
from trainer.errors import UserError
from trainer.loss import LossConfig
from trainer.policies import Plan, Policy, treatments

Status = Literal["exact", "approximated", "not expressible"]
EXACT: Status = "exact"
APPROX: Status = "approximated"
NOT: Status = "not expressible"


class ExportRefused(UserError):
    """A plan or option the chosen target cannot take at all: one line naming what would work (exit 2)."""


@dataclass(frozen=True)
class Element:
    """One run of the plan: consecutive blocks with one treatment, each on its own (`group` 1) or in regions of
    `group` blocks (`sqrt`, `every_k`: one checkpoint per group; the last group may be shorter)."""

    start: int
    stop: int
    treatment: str
    group: int = 1

    @property
    def blocks(self) -> range:
        return range(self.start, self.stop)

    def what(self) -> str:
        grouped = f", groups of {self.group} (one checkpoint each)" if self.group > 1 else ""
        return f"{self.treatment}{grouped}"

    def label(self) -> str:
        where = f"block {self.start}" if self.stop - self.start == 1 else f"blocks {self.start}-{self.stop - 1}"
        return f"{where}: {self.what()}"


def elements(plan: Plan) -> list[Element]:
    """The plan's runs: consecutive segments of one treatment and one size merged (six groups of 2 are one element,
    as `describe` merges per-block segments); a shorter group ending the plan is the groups' last one."""
    out: list[Element] = []
    for s in plan.segments:
        size = s.stop - s.start
        last = out[-1] if out else None
        if last and last.treatment == s.treatment and last.stop == s.start:
            if size == last.group or (size < last.group and s.stop == plan.n_layer):
                out[-1] = Element(last.start, s.stop, s.treatment, last.group)
                continue
        out.append(Element(s.start, s.stop, s.treatment, size))
    return out


@dataclass
class ExportInput:
    """Everything a target reads: the configuration (its loss head included), our plan as it runs on this model
    (each treatment as it really runs: selective under SDPA is `none`), and the model's facts."""

    config: Config
    policy: Policy  # the configured policy (auto: with the planner's choice made)
    plan: Plan
    n_layer: int
    attention: str
    layer_class: type
    dropout: float
    device: str
    precision: str = "32-true"  # settled (auto resolved): what the run trains in

    @property
    def elements(self) -> list[Element]:
        return elements(self.plan)

    @property
    def loss(self) -> LossConfig:
        return self.config.loss

    @property
    def tokens(self) -> int:
        return self.config.batch_size * self.config.seq_len

    @property
    def chunk_tokens(self) -> int:
        return self.loss.chunk_for(self.tokens)

    @property
    def loss_text(self) -> str:
        """The loss head as the rows name it: with the chunk size it runs at, where it has one."""
        name = self.loss.name
        return name if name == "standard" else f"{name} (chunk_tokens={self.chunk_tokens})"

    @property
    def loss_chunks(self) -> int:
        """How many chunks of chunk_tokens the micro-batch's tokens make (the last may be shorter)."""
        return max(1, -(-self.tokens // self.chunk_tokens))

    @property
    def layer_path(self) -> str:
        return f"{self.layer_class.__module__}.{self.layer_class.__qualname__}"

    def treatment(self, name: str) -> Policy:
        """The policy object that runs treatment `name` in our plan (with the configured parameters)."""
        return self.policy.treatment_policy(name)


@dataclass
class Candidate:
    """One plan the target can write for this model: `settings` (structured: what tests feed the target's own
    parser), `text` (what its users paste), and `plan`, the same plan as this project measures it (a custom treatment
    named in `custom` where the target's own has no registered twin, e.g. torchtitan's per-op policy). `runs`: what
    the target does, in our words, where the plan measured differs from it (Hugging Face's offload checkpoints each
    layer and moves the checkpoint's input to the host: it runs `offload`, measured as `full`)."""

    label: str
    settings: dict[str, Any]
    plan: Plan
    custom: dict[str, Policy] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    runs: Plan | None = None

    @property
    def does(self) -> Plan:
        return self.runs if self.runs is not None else self.plan


@dataclass
class LossMap:
    """The loss head in the target's terms: its fidelity, the settings it adds, and the head of ours measured as
    the target's (the closest of conf/loss/)."""

    status: Status
    how: str
    settings: dict[str, Any]
    closest: str

    @classmethod
    def standard(cls, how: str, settings: dict[str, Any] | None = None) -> LossMap:
        """Our standard head, as the target's own."""
        return cls(EXACT, how, dict(settings or {}), "standard")

    @classmethod
    def standard_only(cls, why: str) -> LossMap:
        """A target whose only head is the standard one: ours is not expressible, and loss=standard is measured."""
        return cls(NOT, f"{why}; the closest is loss=standard", {}, "standard")


@dataclass(frozen=True)
class Version:
    """A release of a target whose names differ from the others: `key` is what --target-version takes, `read_from`
    the release the names were read from, `package` the distribution that checks them when installed."""

    key: str
    read_from: str
    package: str | None = None

    def installed(self) -> str | None:
        if self.package is None:
            return None
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return None


class Target:
    """A trainer we export to. Subclasses fill the class attributes and the five methods; `register` lists them."""

    name: ClassVar[str]
    title: ClassVar[str]
    versions: ClassVar[tuple[Version, ...]]  # the first is the default
    show_all_versions: ClassVar[bool] = False  # print every version's form unless --target-version picks one
    groups: ClassVar[bool] = False  # can run several blocks as one checkpointed region
    # The treatments its candidates' plans name that are not ours (e.g. torchtitan's own per-op policy)
    own_treatments: ClassVar[tuple[str, ...]] = ()

    def candidates(self, ctx: ExportInput, version: Version) -> list[Candidate]:
        """The plans this target can write that come nearest ours (an exact one first when there is one)."""
        raise NotImplementedError

    def fidelity(self, e: Element, ctx: ExportInput, version: Version) -> tuple[Status, str] | None:
        """How the target runs an element it runs as we do (same treatment, same blocks); None: it has no way to."""
        raise NotImplementedError

    def similar(self, e: Element, theirs: str, ctx: ExportInput, version: Version) -> str | None:
        """Where the target runs `theirs` on the element's blocks: how that approximates ours, or None (a different
        kind of thing: not expressible)."""
        return None

    def why_not(self, e: Element, ctx: ExportInput, version: Version) -> str:
        """Why the target cannot run this element as we do (one clause)."""
        raise NotImplementedError

    def loss(self, ctx: ExportInput, version: Version) -> LossMap:
        raise NotImplementedError

    def render(self, chosen: Candidate, loss: LossMap, ctx: ExportInput, version: Version) -> str:
        """The settings in the target's own form, loss head included: what a user pastes (and --out writes)."""
        raise NotImplementedError

    def can(self, e: Element, ctx: ExportInput, version: Version) -> bool:
        """Can the target run this element at least approximately (on its own)?"""
        if e.group > 1 and not self.groups:
            return False
        theirs = (*treatments(), *self.own_treatments)
        return self.fidelity(e, ctx, version) is not None or any(self.similar(e, t, ctx, version) for t in theirs)

    def names(self, v: Version) -> str:
        """Which release the names are for, and what is installed here to check them."""
        have = v.installed()
        if have is None:
            return f"names for {v.read_from} (not installed here)"
        other = "" if v.read_from.split(" ")[1].startswith(have) else ", another release"
        return f"names for {v.read_from} (installed here: {v.package} {have}{other})"

    def version(self, key: str | None) -> Version:
        if key is None:
            return self.versions[0]
        for v in self.versions:
            if v.key == key:
                return v
        known = ", ".join(v.key for v in self.versions)
        raise ExportRefused(f"--to {self.name} --target-version {key}: choose one of {known}")

    def selected(self, key: str | None) -> list[Version]:
        if key is not None:
            return [self.version(key)]
        return list(self.versions) if self.show_all_versions else [self.versions[0]]


TARGETS: dict[str, Target] = {}


def register(cls: type[Target]) -> type[Target]:
    TARGETS[cls.name] = cls()
    return cls


def target(name: str) -> Target:
    if name not in TARGETS:
        raise ExportRefused(f"--to {name}: choose one of {', '.join(TARGETS)}")
    return TARGETS[name]


# ----------------------------------------------------------------------------------------------------
# Plan shapes the targets recognise.
# ----------------------------------------------------------------------------------------------------


def uniform(plan: Plan) -> str | None:
    """The treatment of a plan that runs every block alone under one treatment, else None."""
    ts = set(plan.treatments)
    return ts.pop() if len(ts) == 1 and all(not s.group for s in plan.segments) else None


def per_block(plan: Plan) -> tuple[str, ...] | None:
    """The treatments of a plan with no groups, else None."""
    return None if any(s.group for s in plan.segments) else plan.treatments


def group_size(plan: Plan) -> int | None:
    """k where the plan is `Plan.groups(n, k, "full")` with k ≥ 2 (the last group may be shorter), else None."""
    first = plan.segments[0] if plan.segments else None
    if first is None or not first.group:
        return None
    k = first.stop - first.start
    return k if plan == Plan.groups(plan.n_layer, k, "full") else None


def first_n(plan: Plan, treatment: str = "full") -> int | None:
    """N where the plan runs blocks 0..N-1 under `treatment` and the rest under none (0 < N < n_layer)."""
    ts = per_block(plan)
    if ts is None:
        return None
    n = next((i for i, t in enumerate(ts) if t != treatment), len(ts))
    return n if 0 < n < len(ts) and all(t == "none" for t in ts[n:]) else None


def from_zero(n: int) -> int:
    """An every-n-th offset: blocks 0, n, 2n, … (Hugging Face's every_n_layers)."""
    return 0


def from_one(n: int) -> int:
    """An every-n-th offset: blocks counted from 1 whose count divides by n, i.e. indices n-1, 2n-1, …"""
    return n - 1


def every_nth(plan: Plan, offset: Callable[[int], int]) -> int | None:
    """n ≥ 2 where the plan checkpoints (full) exactly the blocks i with i % n == offset(n), the rest none."""
    ts = per_block(plan)
    if ts is None or set(ts) - {"full", "none"}:
        return None
    for n in range(2, len(ts) + 1):
        if ts == every_nth_plan(len(ts), n, offset).treatments:
            return n
    return None


def every_nth_plan(n_layer: int, n: int, offset: Callable[[int], int]) -> Plan:
    return Plan.per_block(["full" if i % n == offset(n) else "none" for i in range(n_layer)])


def covering_nth(plan: Plan, offset: Callable[[int], int]) -> int | None:
    """The largest n ≥ 2 whose every-n-th pattern checkpoints every block our plan recomputes or moves, else None."""
    ts = per_block(plan) or ()
    busy = [i for i, t in enumerate(ts) if t != "none"]
    for n in range(len(ts), 1, -1):
        if busy and all(i % n == offset(n) for i in busy):
            return n
    return None


def checkpoint_and_offload(n_layer: int, settings: dict[str, Any], notes: list[str] | None = None) -> Candidate:
    """A target's offload that checkpoints every block and moves what the checkpoint keeps (its input) to the host:
    it runs `offload` on every block, measured as `full` (the inputs' host copy is not modelled)."""
    full, offload = Plan.uniform(n_layer, "full"), Plan.uniform(n_layer, "offload")
    return Candidate("checkpoint and offload", settings, full, notes=list(notes or []), runs=offload)


def offload_by_checkpoint(theirs: str) -> tuple[Status, str]:
    """The fidelity of `checkpoint_and_offload` to our offload; `theirs`: how the target does it."""
    return APPROX, (
        f"{theirs}; ours recomputes nothing and keeps every activation in host memory. Measured here "
        "as full (the inputs' host copy not modelled)"
    )


def settings_line(text: str) -> str:
    """Rendered settings on one line, for a sentence: their lines joined, comments and blank lines left out."""
    return "; ".join(s for s in text.splitlines() if s.strip() and not s.startswith("#"))


def describe_blocks(plan: Plan, blocks: range) -> str:
    """What a plan does on some blocks, in describe()'s words ("[2-5]:full")."""
    part = [s for s in plan.segments if s.start < blocks.stop and s.stop > blocks.start]
    return Plan(tuple(part)).describe()


def ordinal(n: int) -> str:
    """2 → "2nd", 3 → "3rd", 11 → "11th"."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
