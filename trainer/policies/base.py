"""The policies' engine: the Plan (segments of blocks, each with a treatment), the Policy base class and its
registry (the only list of policies), building a policy from a config, and the checkpoint every recompute uses.
Policies themselves are one class each in library.py; installing a plan on a model is install.py."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Protocol

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.utils.checkpoint import checkpoint

from models.adapter import DecoderAdapter
from trainer.errors import PolicyError

log = logging.getLogger("trainer.policies")  # the package's: its notices are the policies'


# ----------------------------------------------------------------------------------------------------
# The plan: segments of blocks, each with a treatment.
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    start: int  # first block index
    stop: int  # one past the last block
    treatment: str  # a registered treatment; a segment of several blocks is one region (a group)

    @property
    def group(self) -> bool:
        return self.stop - self.start > 1


@dataclass(frozen=True)
class Plan:
    segments: tuple[Segment, ...]

    @classmethod
    def per_block(cls, treatments: Iterable[str]) -> Plan:
        return cls(tuple(Segment(i, i + 1, t) for i, t in enumerate(treatments)))

    @classmethod
    def uniform(cls, n: int, treatment: str) -> Plan:
        return cls.per_block([treatment] * n)

    @classmethod
    def groups(cls, n: int, size: int, treatment: str) -> Plan:
        """Groups of `size` consecutive blocks (the last may be shorter); a group of one is that block alone."""
        return cls(tuple(Segment(i, min(i + size, n), treatment) for i in range(0, n, size)))

    @property
    def n_layer(self) -> int:
        return self.segments[-1].stop if self.segments else 0

    @property
    def treatments(self) -> tuple[str, ...]:
        """One treatment per block."""
        return tuple(s.treatment for s in self.segments for _ in range(s.start, s.stop))

    def replace_treatments(self, change: Callable[[str], str]) -> Plan:
        return Plan(tuple(Segment(s.start, s.stop, change(s.treatment)) for s in self.segments))

    def describe(self) -> str:
        """What runs how, block by block: e.g. "[0]:full [1]:selective [2-3]:none" or "[0-1]:full-group".

        Consecutive single-block segments with the same treatment are merged ("[0-3]:full" = four per-block
        checkpoints); a segment that runs several blocks as ONE region is shown as a group ("[0-1]:full-group"),
        and adjacent groups stay separate.
        """
        runs: list[list[Any]] = []  # [start, stop, label, mergeable]
        for s in self.segments:
            if s.group:
                runs.append([s.start, s.stop, f"{s.treatment}-group", False])
            elif runs and runs[-1][3] and runs[-1][2] == s.treatment and runs[-1][1] == s.start:
                runs[-1][1] = s.stop
            else:
                runs.append([s.start, s.stop, s.treatment, True])
        return " ".join(
            f"[{start}]:{label}" if stop - start == 1 else f"[{start}-{stop - 1}]:{label}"
            for start, stop, label, _ in runs
        )


_said: set[str] = set()


def say_once(msg: str) -> None:
    """Log a notice once per process: a sweep of 50 steps must not repeat it 50 times."""
    if msg not in _said:
        _said.add(msg)
        log.warning(msg)


# ----------------------------------------------------------------------------------------------------
# The policy base class and the registry.
# ----------------------------------------------------------------------------------------------------


@dataclass
class PolicyConfig:
    name: str = "none"


@dataclass
class CompositeConfig(PolicyConfig):
    """A policy whose plan names other treatments (per_block, auto). `params` holds each treatment's own parameters
    under its name, as that treatment's Config declares them: `policy.params.op_sac.save_ops=[aten.mm]`. The
    schema node (`config_node`) lists every treatment's parameters there, so each is overridable and none is
    repeated."""

    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Capabilities:
    """What a policy is and needs, declared once on its class (`caps`): the run, the check, the estimator, the planner,
    the export and the tables read it here instead of asking the policy one question each."""

    treatment: bool = False  # runs one block its own way: per_block and auto can name it
    recomputes_core: bool = False  # wraps the attention seam in a checkpoint (selective)
    recomputes: bool = False  # replays its blocks' forward (or ops of it) in backward (full, op_sac)
    # Its plan is chosen on the model before it runs (auto: at fit start, by a callback it brings); until then a
    # table says `unplanned` for it.
    planned_first: bool = False
    unplanned: str = ""
    # Decided by torch's compiler, not by a plan the eager step runs (memory_budget): it needs trainer.compile=true,
    # and the estimator estimates it only there (trainer.measure.fake.compiled).
    requires_compile: bool = False
    # the Lightning callbacks a run of it needs, as "module:Class" (constructed with the policy and the run's config)
    brings: tuple[str, ...] = ()

    @property
    def replays_forward(self) -> bool:
        """Runs (part of) its blocks' forward again in backward: a layer's side effects (a KV-cache append) repeat."""
        return self.recomputes or self.recomputes_core

    def not_estimated(self, compiled: bool) -> str:
        """What the estimator says instead of an estimate of this policy, or "" where it estimates it."""
        if self.requires_compile and not compiled:
            return "decided by torch.compile's partitioner: estimated under trainer.compile=true"
        return ""


class Treatment(Protocol):
    """How one segment of blocks runs (none, full, selective, op_sac, torchtitan_sac, offload): what install_plan
    and the planner ask of a treatment."""

    name: ClassVar[str]
    caps: ClassVar[Capabilities]

    def run(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, key: int) -> torch.Tensor: ...
    def effective(self, attention: str) -> str: ...
    def unavailable(self, attention: str, device_type: str) -> str | None: ...


class Planner(Protocol):
    """Which treatment each block gets (first_k, every_k, sqrt, per_block, auto, memory_budget; a treatment plans
    itself on every block): what apply_policy asks of a policy before it installs the plan."""

    def check(self, n_layer: int, attention: str) -> None: ...
    def plan(self, n_layer: int) -> Plan: ...
    def choose(self, block_treatments: Iterable[str]) -> None: ...
    def treatment_policy(self, name: str) -> Treatment: ...


class Policy:
    """One activation-memory policy: a documented `Config`, what it is (`caps`) and a `plan`; a treatment also says
    how it runs a segment (`run`). Every policy is a Planner and, with `caps.treatment`, a Treatment."""

    name: ClassVar[str]
    Config: ClassVar[type[PolicyConfig]] = PolicyConfig
    caps: ClassVar[Capabilities] = Capabilities()

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self._children: dict[str, Policy] = {}
        self._callbacks: list[Any] | None = None

    def plan(self, n_layer: int) -> Plan:
        """The blocks' treatments; a treatment's own plan is itself on every block."""
        if not self.caps.treatment:
            raise NotImplementedError(type(self).__name__)
        return Plan.uniform(n_layer, self.name)

    def check(self, n_layer: int, attention: str) -> None:
        """Refuse parameters that cannot fit this model, before any work starts (one-line PolicyError)."""

    def refusal(self, compiled: bool, dropout: bool) -> str | None:
        """Why this policy cannot train this module (compiled or not, drawing dropout or not), or None."""
        if self.caps.requires_compile and not compiled:
            return f"policy {self.name} is decided by torch.compile's partitioner: it needs trainer.compile=true"
        return None

    def compile_backend(self, inner_compile: Any = None) -> Any:
        """The torch.compile backend the model compiles with under trainer.compile=true (called once per module).
        `inner_compile`: inductor's partitioning with another code generator in place of its own (the estimator's
        op-by-op graphs, trainer.measure.fake.compiled)."""
        if inner_compile is None:
            return "inductor"
        import functools

        from torch._inductor.compile_fx import compile_fx

        return functools.partial(compile_fx, inner_compile=inner_compile)

    def choose(self, block_treatments: Iterable[str]) -> None:
        """A planned policy takes the plan its planner chose, one treatment per block."""
        raise PolicyError(f"policy {self.name} is not planned; its plan is its own")

    def callbacks(self, config: Any = None) -> list[Any]:
        """The Lightning callbacks a run of this policy needs (the classes its `caps.brings` names, each constructed
        with the policy and `config`), made once per policy object: the run, the checker and the estimator ask the
        policy and name none. `config`: the run's (auto's planner plans a compiled run from it, on fake tensors)."""
        if self._callbacks is None:
            self._callbacks = [_named(path)(self, config) for path in self.caps.brings]
        return self._callbacks

    # -- treatments -------------------------------------------------------------------------------------------
    def run(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, key: int) -> torch.Tensor:
        """Run one segment: `fn(x)` runs its blocks on the residual stream x. `key`: the segment's first block."""
        return fn(x)

    def effective(self, attention: str) -> str:
        """The treatment this one amounts to on a model with this attention (selective without an eager core:
        none), so a plan says what really runs."""
        return self.name

    def unavailable(self, attention: str, device_type: str) -> str | None:
        """Why this treatment would change nothing here (the planner leaves it out and says so), or None."""
        return None

    def treatment_policy(self, name: str) -> Policy:
        """The policy object that runs treatment `name` in this policy's plan, with the parameters a composite
        config gives it (`params[name]`; the treatment's defaults otherwise). One object per name, kept."""
        if name == self.name:
            return self
        if name not in self._children:
            cls = POLICIES.get(name)
            if cls is None or not cls.caps.treatment:
                known = ", ".join(treatments())
                raise PolicyError(f"policy {self.name}: unknown treatment {name!r}; choose from {known}")
            params = (self.cfg.params.get(name) or {}) if isinstance(self.cfg, CompositeConfig) else {}
            try:
                self._children[name] = build_policy({**params, "name": name})
            except (
                PolicyError
            ) as e:  # "policy op_sac: policy.save_ops: …" → "policy auto: policy.params.op_sac.save_ops"
                why = str(e).split(": ", 1)[-1]
                where = f".{why.removeprefix('policy.')}" if why.startswith("policy.") else f": {why}"
                raise PolicyError(f"policy {self.name}: policy.params.{name}{where}") from None
        return self._children[name]


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


def _named(path: str) -> Any:
    """`module:Class` → the class. By name, so a policy names the callbacks it brings without importing them (the
    policies import no callback; the callbacks import the policies)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def moved_parameter(key: str) -> str | None:
    """Where a treatment's parameter goes when it is given to a composite policy at its top level
    (`policy.save_ops` under per_block or auto): "policy.params.op_sac.save_ops", or None for any other key."""
    owners = [t for t in treatments() if key in {f.name for f in fields(POLICIES[t].Config)} - {"name"}]
    return " or ".join(f"policy.params.{t}.{key}" for t in owners) or None


def config_node(cls: type[Policy]) -> DictConfig:
    """The Hydra schema of a policy's config (conf/policy/<name>.yaml extends it, so yaml repeats no default): its
    Config's fields, its name, and for a composite every treatment's own parameters under `params`."""
    # The class's field defaults (no __post_init__: yaml fills the rest), as a plain node: the composed config holds
    # the policy as a mapping, and build_policy types it against the class.
    node = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(cls.Config)))
    node.name = cls.name
    if issubclass(cls.Config, CompositeConfig):
        params = {}
        for t in treatments():
            own = {f.name: f for f in fields(POLICIES[t].Config) if f.name != "name"}
            if own:
                values = OmegaConf.to_container(OmegaConf.structured(POLICIES[t].Config))
                params[t] = {k: v for k, v in values.items() if k in own}  # type: ignore[union-attr]
        node.params = params
    return node


def treatments() -> tuple[str, ...]:
    """The registered treatments, in registration order (what per_block and auto may name)."""
    return tuple(n for n, c in POLICIES.items() if c.caps.treatment)


def check_treatments(names: Iterable[str], key: str) -> None:
    """A config's list of treatment names, each registered (raises ValueError: a Config's __post_init__ check)."""
    known = treatments()
    for t in names:
        if t not in known:
            raise ValueError(f"unknown treatment {t!r} in policy.{key}; choose from {', '.join(known)}")


# ----------------------------------------------------------------------------------------------------
# Building and installing.
# ----------------------------------------------------------------------------------------------------


def build_policy(cfg: Mapping[str, Any] | DictConfig | PolicyConfig | str) -> Policy:
    """Validate a policy config (a Hydra node, a dict or a name) into a Policy, or raise a one-line PolicyError."""
    if isinstance(cfg, str):
        cfg = {"name": cfg}
    if isinstance(cfg, PolicyConfig):
        cfg = OmegaConf.structured(cfg)
    name = cfg.get("name") if hasattr(cfg, "get") else None
    if name not in POLICIES:
        raise PolicyError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}")
    cls = POLICIES[name]
    try:
        node = OmegaConf.merge(OmegaConf.structured(cls.Config), cfg)
        typed = OmegaConf.to_object(node)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        msg = str(e).splitlines()[0]
        if issubclass(cls.Config, CompositeConfig) and (moved := moved_parameter(key)):
            raise PolicyError(f"policy {name}: policy.{key} is a treatment's parameter here; give {moved}") from None
        raise PolicyError(f"policy {name}: {('policy.' + key + ': ') if key else ''}{msg}") from None
    except ValueError as e:  # a Config.__post_init__ check
        raise PolicyError(f"policy {name}: {e}") from None
    policy = cls(typed)
    if isinstance(typed, CompositeConfig):  # each treatment's parameters, validated by that treatment's Config
        for t in typed.params:
            if t not in treatments():
                raise PolicyError(
                    f"policy {name}: policy.params.{t}: not a treatment; give one of {', '.join(treatments())}"
                )
            policy.treatment_policy(t)
    return policy


def policy_params(policy: Policy) -> dict[str, Any]:
    return {f.name: getattr(policy.cfg, f.name) for f in fields(policy.cfg)}


def resolve_plan(policy: Policy, adapter: DecoderAdapter, planned: Plan | None = None) -> Plan:
    """The policy's plan for this model (or `planned`, the one it already made), each treatment as it really runs
    here (`Policy.effective`)."""
    attention = adapter.attention
    planned = planned if planned is not None else policy.plan(adapter.n_layer)
    return planned.replace_treatments(lambda t: policy.treatment_policy(t).effective(attention))


def needs_attention_seam(policy: Policy, n_layer: int) -> bool:
    """Does the policy's plan for n_layer blocks recompute the core attention somewhere (selective)?"""
    return any(policy.treatment_policy(t).caps.recomputes_core for t in policy.plan(n_layer).treatments)


def no_seam_refusal(policy: Policy, model_name: str) -> PolicyError:
    return PolicyError(
        f"policy {policy.cfg.name}: {model_name} has no swappable attention function (it computes attention "
        "inline, or has none), so there is no core attention to recompute on its own; choose op_sac or full for "
        "this model"
    )


def checkpointed(fn: Callable[..., Any], *args: Any, context_fn: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` under non-reentrant checkpoint with the RNG state preserved (dropout replays);
    `context_fn`: torch's selective-checkpoint contexts (op_sac)."""
    if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved, so nothing to recompute
        return fn(*args, **kwargs)
    extra = {} if context_fn is None else {"context_fn": context_fn}
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)
