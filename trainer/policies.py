"""Every activation-memory policy, the registry, and the one entry point `apply_policy(model, cfg)`.

A policy decides, per transformer block, how its activations survive until the backward:

  store      keep everything (autograd's default)
  full       keep only the segment's input; recompute the internals in backward (torch.utils.checkpoint)
  selective  keep everything but the core attention (QKᵀ, softmax, dropout, ·V), which is recomputed
  op_sac     per-op: save the listed ops' outputs (matmuls, attention kernels), recompute the rest
  offload    keep everything, but in host memory instead of the device

Policies compile to a list of `Segment`s (a run of consecutive blocks and how to run it) plus the set of blocks
whose core attention is recomputed. `apply_policy` installs that schedule on the model's two seams
(`GPT.run_blocks`, `CausalSelfAttention.core_attention`) as instance attributes: no module is wrapped, so
`state_dict` keys never change and a checkpoint moves freely between policies.

Recompute always uses non-reentrant checkpointing with `preserve_rng_state=True`, so dropout replays the same
masks and gradients equal the `none` policy's bit for bit where the arithmetic is the same.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

log = logging.getLogger(__name__)

SegmentMode = Literal["store", "checkpoint", "op_sac", "offload"]
TREATMENTS = ("none", "full", "selective", "op_sac", "offload")


class PolicyError(ValueError):
    """A bad policy name or parameter; the message is one line that names the fix."""


@dataclass(frozen=True)
class Segment:
    start: int  # first block index
    stop: int  # one past the last block
    mode: SegmentMode


@dataclass(frozen=True)
class Plan:
    segments: tuple[Segment, ...]
    selective_blocks: frozenset[int] = frozenset()  # blocks whose core attention is recomputed

    def treatment_of(self, block: int) -> str:
        if block in self.selective_blocks:
            return "selective"
        for s in self.segments:
            if s.start <= block < s.stop:
                return {"store": "none", "checkpoint": "full", "op_sac": "op_sac", "offload": "offload"}[s.mode]
        raise IndexError(block)

    def describe(self) -> str:
        """What runs how, block by block: e.g. "[0]:full [1]:selective [2]:none [3]:op_sac" or "[0-1]:full-group".

        Consecutive blocks with the same treatment are merged ("[0-3]:full" = four per-block checkpoints); a
        segment that checkpoints several blocks as ONE region is shown as a group ("[0-1]:full-group"), and
        adjacent groups stay separate. Labels are per block, so a store segment that mixes plain and selective
        blocks is never labelled as a whole by one of them.
        """
        runs: list[list[Any]] = []  # [start, stop, label, mergeable]
        for s in self.segments:
            if s.mode in ("checkpoint", "op_sac") and s.stop - s.start > 1:
                runs.append([s.start, s.stop, f"{self.treatment_of(s.start)}-group", False])
                continue
            for b in range(s.start, s.stop):
                label = self.treatment_of(b)
                if runs and runs[-1][3] and runs[-1][2] == label and runs[-1][1] == b:
                    runs[-1][1] = b + 1
                else:
                    runs.append([b, b + 1, label, True])
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
# Policies: one class each, a documented Config, and `plan(model)`.
# ----------------------------------------------------------------------------------------------------


@dataclass
class PolicyConfig:
    name: str = "none"


class Policy:
    name: ClassVar[str]
    Config: ClassVar[type[PolicyConfig]] = PolicyConfig

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg

    def plan(self, model: nn.Module) -> Plan:
        raise NotImplementedError

    def check(self, n_layer: int, attention: str) -> None:
        """Refuse parameters that cannot fit this model, before any work starts."""


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


def _per_block(n: int, mode: SegmentMode) -> tuple[Segment, ...]:
    return tuple(Segment(i, i + 1, mode) for i in range(n))


def _groups(n: int, size: int, mode: SegmentMode) -> tuple[Segment, ...]:
    return tuple(Segment(i, min(i + size, n), mode) for i in range(0, n, size))


def _n_layer(model: nn.Module) -> int:
    return len(model.blocks)


@register
class NoRecompute(Policy):
    """Store every activation: the fastest step and the memory baseline the others are measured against."""

    name = "none"

    def plan(self, model: nn.Module) -> Plan:
        return Plan((Segment(0, _n_layer(model), "store"),))


@register
class FullRecompute(Policy):
    """Checkpoint every block: only each block's input (the residual stream) is kept; +1 forward of compute."""

    name = "full"

    def plan(self, model: nn.Module) -> Plan:
        return Plan(_per_block(_n_layer(model), "checkpoint"))


@register
class SelectiveRecompute(Policy):
    """Recompute only the core attention (Korthikanti et al. 2022; Megatron `core_attn`).

    Drops the 5as/h·sbh attention-score term for a few % more FLOPs. With fused SDPA there is no score tensor
    to drop and the kernel already recomputes in its backward, so this stores attention exactly like `none`.
    """

    name = "selective"

    def check(self, n_layer: int, attention: str) -> None:
        if attention == "sdpa":
            say_once(
                "policy=selective with model.attention=sdpa: the fused kernel already recomputes its scores in "
                "backward, so attention is stored as under `none` (no second recompute); note that on CPU with "
                "dropout > 0 SDPA falls back to its math path, which does keep the T×T probabilities; "
                "use model.attention=eager for Megatron-style selective recompute"
            )

    def plan(self, model: nn.Module) -> Plan:
        n = _n_layer(model)
        eager = [i for i, b in enumerate(model.blocks) if b.attn.attention == "eager"]
        return Plan((Segment(0, n, "store"),), frozenset(eager))


@register
class SqrtGroups(Policy):
    """Chen et al. 2016: ⌈√L⌉ groups of consecutive blocks, one checkpoint per group.

    Keeps √L group inputs, but recomputing a group holds all its blocks' internals at once; a transformer
    block's internals dwarf its input, so this can peak ABOVE `full` (the tests show it, measured).
    """

    name = "sqrt"

    def plan(self, model: nn.Module) -> Plan:
        n = _n_layer(model)
        size = -(-n // ceil_sqrt(n))
        return Plan(_groups(n, size, "checkpoint"))


@dataclass
class KConfig(PolicyConfig):
    k: int = 2


class _KPolicy(Policy):
    Config = KConfig

    def check(self, n_layer: int, attention: str) -> None:
        if not 1 <= self.cfg.k <= n_layer:
            raise PolicyError(
                f"policy {self.name}: policy.k={self.cfg.k} must be between 1 and model.n_layer={n_layer}"
            )


@register
class EveryK(_KPolicy):
    """Megatron `recompute_method=uniform`: groups of `k` consecutive blocks, one checkpoint per group."""

    name = "every_k"

    def plan(self, model: nn.Module) -> Plan:
        return Plan(_groups(_n_layer(model), self.cfg.k, "checkpoint"))


@register
class FirstK(_KPolicy):
    """Megatron `recompute_method=block`: checkpoint each of the first `k` blocks, store the rest."""

    name = "first_k"

    def plan(self, model: nn.Module) -> Plan:
        n = _n_layer(model)
        rest = (Segment(self.cfg.k, n, "store"),) if self.cfg.k < n else ()
        return Plan(_per_block(self.cfg.k, "checkpoint") + rest)


# torchtitan's default idea: keep what is expensive to recompute (matmuls, attention kernels), recompute the
# cheap pointwise ops. Names are aten packets; every overload of a named packet is saved.
DEFAULT_SAC_SAVE_OPS = [
    "aten.mm",
    "aten.addmm",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
]


@dataclass
class OpSacConfig(PolicyConfig):
    save_ops: list[str] = field(default_factory=lambda: list(DEFAULT_SAC_SAVE_OPS))


def resolve_ops(names: Iterable[str], policy: str = "op_sac") -> frozenset[Any]:
    """Op names ('aten.mm', 'aten.mm.default') to op packets; every overload of a named packet matches."""
    ops = set()
    for name in names:
        ns, _, op = str(name).partition(".")
        try:
            packet = getattr(getattr(torch.ops, ns), op.split(".")[0]) if ns and op else None
        except (AttributeError, RuntimeError):
            packet = None
        if packet is None:
            raise PolicyError(
                f"policy {policy}: policy.save_ops: unknown op {name!r}; write it as 'aten.mm' (namespace.op)"
            )
        ops.add(packet)
    return frozenset(ops)


class _SacMixin:
    cfg: Any

    def sac_context(self) -> Callable[[], Any]:
        save = resolve_ops(self.cfg.save_ops)

        def decide(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            packet = getattr(op, "overloadpacket", op)
            return CheckpointPolicy.MUST_SAVE if packet in save else CheckpointPolicy.PREFER_RECOMPUTE

        return functools.partial(create_selective_checkpoint_contexts, decide)


@register
class OpLevelSAC(_SacMixin, Policy):
    """Per-op selective activation checkpointing (torch's SAC contexts) on every block."""

    name = "op_sac"
    Config = OpSacConfig

    def check(self, n_layer: int, attention: str) -> None:
        resolve_ops(self.cfg.save_ops)

    def plan(self, model: nn.Module) -> Plan:
        return Plan(_per_block(_n_layer(model), "op_sac"))


@dataclass
class OffloadConfig(PolicyConfig):
    min_bytes: int = 1 << 16  # smaller tensors stay on the device: a copy costs more than the bytes it frees
    prefetch: bool = True  # in backward, bring the previous block's tensors back while this block computes

    def __post_init__(self) -> None:
        if self.min_bytes < 0:
            raise ValueError(f"policy.min_bytes={self.min_bytes} must be ≥ 0")


class _OffloadMixin:
    cfg: Any
    _offloader: ActivationOffloader | None = None

    def offloader(self) -> ActivationOffloader:
        if self._offloader is None:
            self._offloader = ActivationOffloader(self.cfg.min_bytes, self.cfg.prefetch)
        return self._offloader


@register
class Offload(_OffloadMixin, Policy):
    """Keep every block's activations in pinned host memory, copied on side CUDA streams with prefetch."""

    name = "offload"
    Config = OffloadConfig

    def check(self, n_layer: int, attention: str) -> None:
        if not torch.cuda.is_available():
            say_once(
                "policy=offload without a CUDA device: activations are already in host memory, "
                "so the move is a no-op (gradients are unchanged)"
            )

    def plan(self, model: nn.Module) -> Plan:
        return Plan(_per_block(_n_layer(model), "offload"))


@dataclass
class PerBlockConfig(OpSacConfig, OffloadConfig):
    blocks: list[str] = field(default_factory=list)  # one treatment per block, e.g. [full, full, offload, none]
    pattern: list[str] = field(default_factory=list)  # repeated to cover the blocks, e.g. [full, none]

    def __post_init__(self) -> None:
        super().__post_init__()
        # `blocks` wins when given, so `policy.blocks=[...]` works on top of the yaml's default pattern.
        if not self.blocks and not self.pattern:
            raise ValueError("give policy.blocks=[...] (one treatment per block) or policy.pattern=[...] (repeated)")
        for t in self.blocks or self.pattern:
            if t not in TREATMENTS:
                raise ValueError(
                    f"unknown treatment {t!r} in policy.{'blocks' if self.blocks else 'pattern'}; "
                    f"choose from {', '.join(TREATMENTS)}"
                )


_MODE_OF = {"none": "store", "selective": "store", "full": "checkpoint", "op_sac": "op_sac", "offload": "offload"}


@register
class PerBlock(_SacMixin, _OffloadMixin, Policy):
    """A treatment per block: the building block of the memory-budget planner."""

    name = "per_block"
    Config = PerBlockConfig

    def treatments(self, n_layer: int) -> list[str]:
        if self.cfg.blocks:
            return list(self.cfg.blocks)
        return [self.cfg.pattern[i % len(self.cfg.pattern)] for i in range(n_layer)]

    def check(self, n_layer: int, attention: str) -> None:
        if self.cfg.blocks and len(self.cfg.blocks) != n_layer:
            raise PolicyError(
                f"policy per_block: policy.blocks has {len(self.cfg.blocks)} entries but the model "
                f"has {n_layer} blocks; give one treatment per block"
            )
        used = set(self.treatments(n_layer))
        if "op_sac" in used:
            resolve_ops(self.cfg.save_ops, self.name)
        if "selective" in used:
            SelectiveRecompute.check(self, n_layer, attention)  # type: ignore[arg-type]
        if "offload" in used:
            Offload.check(self, n_layer, attention)  # type: ignore[arg-type]

    def plan(self, model: nn.Module) -> Plan:
        return plan_from_treatments(model, self.treatments(_n_layer(model)))


def plan_from_treatments(model: nn.Module, treatments: list[str] | tuple[str, ...]) -> Plan:
    """One treatment per block → a Plan (what `per_block` and `auto` install): one segment per recomputed or
    offloaded block, consecutive stored blocks in one segment, selective only where attention is eager."""
    segments: list[Segment] = []
    for i, t in enumerate(treatments):
        mode: SegmentMode = _MODE_OF[t]  # type: ignore[assignment]
        if mode == "store" and segments and segments[-1].mode == "store" and segments[-1].stop == i:
            segments[-1] = Segment(segments[-1].start, i + 1, "store")
        else:
            segments.append(Segment(i, i + 1, mode))
    eager = {i for i, b in enumerate(model.blocks) if b.attn.attention == "eager"}
    selective = {i for i, t in enumerate(treatments) if t == "selective"} & eager
    return Plan(tuple(segments), frozenset(selective))


@dataclass
class AutoConfig(OpSacConfig, OffloadConfig):
    """policy=auto: the fastest per-block plan whose predicted whole-step peak fits the budget (trainer/planner.py).

    The budget bounds the step's whole peak as the run reports it (`peak_total_mib`: the CUDA allocator's peak, or
    the live-tensor tracker's on CPU). Give exactly one of budget_mib, budget_gb (10^9 bytes) or budget_fraction
    (of the CUDA device's total memory).
    """

    budget_mib: float | None = None
    budget_gb: float | None = None
    budget_fraction: float | None = None
    allow_accum: bool = False  # nothing fits: halve the micro-batch, double accum (same tokens per step), retry
    profile_repeats: int = 3  # timed repetitions per block and treatment (median)
    # offload is used only where there is a CUDA device (elsewhere it is `none`); selective only with eager attention
    candidates: list[str] = field(default_factory=lambda: ["none", "selective", "op_sac", "full", "offload"])

    def __post_init__(self) -> None:
        super().__post_init__()
        given = [k for k in ("budget_mib", "budget_gb", "budget_fraction") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(
                f"give exactly one of policy.budget_mib, policy.budget_gb, policy.budget_fraction "
                f"(got {', '.join(given)})"
            )
        for k in given:
            if not getattr(self, k) > 0:
                raise ValueError(f"policy.{k}={getattr(self, k)} must be > 0")
        if self.budget_fraction is not None and self.budget_fraction > 1:
            raise ValueError(f"policy.budget_fraction={self.budget_fraction} must be in (0, 1]")
        if self.profile_repeats < 1:
            raise ValueError(f"policy.profile_repeats={self.profile_repeats} must be ≥ 1")
        if not self.candidates:
            raise ValueError("policy.candidates is empty; list some of none, selective, op_sac, full, offload")
        for t in self.candidates:
            if t not in TREATMENTS:
                raise ValueError(f"unknown treatment {t!r} in policy.candidates; choose from {', '.join(TREATMENTS)}")


@register
class Auto(_SacMixin, _OffloadMixin, Policy):
    """The memory-budget planner's policy: a per-block plan chosen at fit start by `callbacks.planner`.

    `plan()` installs the chosen treatments (`choose`); before a choice is made it checkpoints every block (`full`,
    the frugal default), so a model used without the planning callback never exceeds what `full` needs.
    """

    name = "auto"
    Config = AutoConfig
    chosen: tuple[str, ...] | None = None  # the planner's treatments, one per block
    planned_by: Any = None  # weak reference to the callback that planned it (one planner per model)

    def choose(self, treatments: list[str] | tuple[str, ...]) -> None:
        for t in treatments:
            if t not in TREATMENTS:
                raise PolicyError(f"policy auto: unknown treatment {t!r}")
        self.chosen = tuple(treatments)

    def check(self, n_layer: int, attention: str) -> None:
        given = [k for k in ("budget_mib", "budget_gb", "budget_fraction") if getattr(self.cfg, k) is not None]
        if not given:
            raise PolicyError(
                "policy auto needs a budget: give one of policy.budget_mib=…, policy.budget_gb=… or "
                "policy.budget_fraction=… (of the CUDA device's memory)"
            )
        if self.cfg.budget_fraction is not None and not torch.cuda.is_available():
            raise PolicyError(
                f"policy auto: policy.budget_fraction={self.cfg.budget_fraction} is a fraction of a CUDA device's "
                "memory and there is none here; give policy.budget_mib=… instead"
            )
        if "op_sac" in self.cfg.candidates:
            resolve_ops(self.cfg.save_ops, self.name)
        if self.chosen is not None and len(self.chosen) != n_layer:
            raise PolicyError(f"policy auto: the chosen plan has {len(self.chosen)} blocks, the model {n_layer}")

    def plan(self, model: nn.Module) -> Plan:
        n = _n_layer(model)
        if self.chosen is None:
            return plan_from_treatments(model, ["full"] * n)
        return plan_from_treatments(model, list(self.chosen))


class ActivationOffloader:
    """Moves saved activations to pinned host memory in forward and back in backward (torchtune's pattern).

    Device→host copies run on a side stream after an event from the compute stream, so forward compute is not
    blocked; in backward, the first unpack of a block's tensors starts host→device copies of the block before
    it (prefetch), which then overlap this block's backward. `torch.autograd.graph.save_on_cpu` is the
    synchronous version of this; it cannot overlap. Tensors not on CUDA, below `min_bytes`, or parameters
    are left where they are, which makes the whole thing a no-op on CPU.
    """

    def __init__(self, min_bytes: int, prefetch: bool) -> None:
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self._stash: dict[int, list[_Offloaded]] = {}
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self.bytes_offloaded = 0  # cumulative, for the tests and the log

    def _side_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(), torch.cuda.Stream())
        return self._streams

    def run(self, segment: int, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or x.device.type != "cuda":
            return fn(x)
        self._stash[segment] = []  # entries of an earlier forward left here are fetched one by one in _unpack
        with torch.autograd.graph.saved_tensors_hooks(
            functools.partial(self._pack, segment), functools.partial(self._unpack, segment)
        ):
            return fn(x)

    def _pack(self, segment: int, t: torch.Tensor) -> Any:
        if t.device.type != "cuda" or t.nbytes < self.min_bytes or _is_parameter(t):
            return t
        d2h, _ = self._side_streams()
        d2h.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(d2h):
            host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=True)
            host.copy_(t, non_blocking=True)
            # The allocator must not hand t's memory to a new tensor before the copy has read it.
            t.record_stream(d2h)
            done = torch.cuda.Event()
            done.record(d2h)
        self.bytes_offloaded += t.nbytes
        entry = _Offloaded(host=host, device=t.device, copied=done)
        self._stash.setdefault(segment, []).append(entry)
        return entry

    def _unpack(self, segment: int, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.on_device is None:
            self._bring_back(segment)
        if packed.on_device is None:
            # Not in the stash: a second forward of this segment (e.g. two micro-batches before one backward)
            # replaced the stash entry. Bring this tensor back on its own rather than fail.
            self._fetch([packed])
        if self.prefetch and segment - 1 in self._stash:
            self._bring_back(segment - 1)
        compute = torch.cuda.current_stream(packed.device)
        compute.wait_event(packed.arrived)  # type: ignore[arg-type]
        t = packed.on_device
        assert t is not None
        t.record_stream(compute)
        return t

    def _bring_back(self, segment: int) -> None:
        self._fetch(self._stash.pop(segment, []))

    def _fetch(self, entries: list[_Offloaded]) -> None:
        _, h2d = self._side_streams()
        for e in entries:
            if e.on_device is not None:
                continue
            h2d.wait_event(e.copied)
            with torch.cuda.stream(h2d):
                e.on_device = e.host.to(e.device, non_blocking=True)
                e.arrived = torch.cuda.Event()
                e.arrived.record(h2d)


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (Linear saves `weight.t()`): its bytes stay on the device anyway."""
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


@dataclass
class _Offloaded:
    host: torch.Tensor
    device: torch.device
    copied: Any
    on_device: torch.Tensor | None = None
    arrived: Any = None


# ----------------------------------------------------------------------------------------------------
# The entry point.
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
        raise PolicyError(f"policy {name}: {('policy.' + key + ': ') if key else ''}{msg}") from None
    except ValueError as e:  # a Config.__post_init__ check
        raise PolicyError(f"policy {name}: {e}") from None
    return cls(typed)


def policy_params(policy: Policy) -> dict[str, Any]:
    return {f.name: getattr(policy.cfg, f.name) for f in fields(policy.cfg)}


def apply_policy(model: nn.Module, cfg: Policy | Mapping[str, Any] | DictConfig | str) -> Policy:
    """Install a policy on a GPT (any model with `.blocks` whose blocks have `.attn.core_attention`).

    Idempotent and reversible: a previous policy is removed first; `remove_policy` restores the plain model.
    """
    policy = cfg if isinstance(cfg, Policy) else build_policy(cfg)
    attention = model.blocks[0].attn.attention
    policy.check(_n_layer(model), attention)
    plan = policy.plan(model)
    remove_policy(model)
    _install(model, plan, policy)
    model.activation_policy = policy  # type: ignore[assignment]  # read by the callback and summaries
    model.activation_plan = plan  # type: ignore[assignment]
    return policy


def remove_policy(model: nn.Module) -> None:
    for obj, attr in [(model, "run_blocks")] + [(b.attn, "core_attention") for b in model.blocks]:
        obj.__dict__.pop(attr, None)
    model.__dict__.pop("activation_policy", None)
    model.__dict__.pop("activation_plan", None)


def _install(model: nn.Module, plan: Plan, policy: Policy) -> None:
    blocks = model.blocks
    for i in plan.selective_blocks:
        attn = blocks[i].attn
        # Bound method of the class, so the patched attribute never calls itself.
        core = type(attn).core_attention.__get__(attn)
        attn.core_attention = functools.partial(_checkpointed, core)
    if plan.segments == (Segment(0, len(blocks), "store"),):
        return  # plain loop: leave the class method in place
    contexts = {s: _segment_runner(s, policy) for s in plan.segments}
    model.run_blocks = functools.partial(_run_plan, blocks, plan.segments, contexts)


def _run_range(blocks: nn.ModuleList, start: int, stop: int, x: torch.Tensor) -> torch.Tensor:
    for i in range(start, stop):
        x = blocks[i](x)
    return x


def _checkpointed(fn: Callable[..., torch.Tensor], *args: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved, so nothing to recompute
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def _segment_runner(seg: Segment, policy: Policy) -> Callable[[nn.ModuleList, torch.Tensor], torch.Tensor]:
    def store(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
        return _run_range(blocks, seg.start, seg.stop, x)

    if seg.mode == "store":
        return store
    if seg.mode == "checkpoint":
        return lambda blocks, x: _checkpointed(functools.partial(_run_range, blocks, seg.start, seg.stop), x)
    if seg.mode == "op_sac":
        ctx = policy.sac_context()  # type: ignore[attr-defined]
        return lambda blocks, x: _checkpointed(
            functools.partial(_run_range, blocks, seg.start, seg.stop), x, context_fn=ctx
        )
    if seg.mode == "offload":
        offloader = policy.offloader()  # type: ignore[attr-defined]
        return lambda blocks, x: offloader.run(seg.start, functools.partial(_run_range, blocks, seg.start, seg.stop), x)
    raise AssertionError(seg.mode)


def _run_plan(
    blocks: nn.ModuleList,
    segments: Iterable[Segment],
    runners: Mapping[Segment, Callable[[nn.ModuleList, torch.Tensor], torch.Tensor]],
    x: torch.Tensor,
) -> torch.Tensor:
    for seg in segments:
        x = runners[seg](blocks, x)
    return x


def ceil_sqrt(n: int) -> int:
    return math.isqrt(n - 1) + 1 if n > 0 else 0


__all__ = [
    "POLICIES",
    "TREATMENTS",
    "Plan",
    "Policy",
    "PolicyConfig",
    "PolicyError",
    "Segment",
    "apply_policy",
    "build_policy",
    "plan_from_treatments",
    "policy_params",
    "remove_policy",
]
