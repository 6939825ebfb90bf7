"""Every registered policy: one class each, with its documented Config. Registration order is the order tables
and reports list them in (roughly from most memory to least)."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from trainer.errors import PolicyError
from trainer.loss import LOSSES
from trainer.measure.time.flops import count_sac_decision
from trainer.policies.base import (
    Capabilities,
    CompositeConfig,
    Plan,
    Policy,
    PolicyConfig,
    check_treatments,
    checkpointed,
    register,
    say_once,
    treatments,
)
from trainer.policies.offload import ActivationOffloader

log = logging.getLogger(__name__)


@register
class NoRecompute(Policy):
    """Store every activation: the fastest step and the memory baseline the others are measured against."""

    name = "none"
    caps = Capabilities(treatment=True)


@register
class SelectiveRecompute(Policy):
    """Recompute only the core attention (Korthikanti et al. 2022; Megatron `core_attn`).

    Drops the 5as/h·sbh attention-score term for a few % more FLOPs. With fused SDPA there is no score tensor
    to drop and the kernel already recomputes in its backward, so this stores attention exactly like `none`.
    """

    name = "selective"
    caps = Capabilities(treatment=True, recomputes_core=True)

    def check(self, n_layer: int, attention: str) -> None:
        if attention == "sdpa":
            say_once(
                "policy=selective with model.attention=sdpa: the fused kernel already recomputes its scores in "
                "backward, so attention is stored as under `none` (no second recompute); note that on CPU with "
                "dropout > 0 SDPA falls back to its math path, which does keep the T×T probabilities; "
                "use model.attention=eager for Megatron-style selective recompute"
            )

    def effective(self, attention: str) -> str:
        return self.name if attention == "eager" else "none"

    def unavailable(self, attention: str, device_type: str) -> str | None:
        return None if attention == "eager" else "with model.attention=sdpa it stores attention like `none`"


# torchtitan's default idea: keep what is expensive to recompute (matmuls, attention kernels), recompute the
# cheap pointwise ops. Names are aten packets; every overload of a named packet is saved. Eager attention's two
# batched matmuls (aten.bmm: QKᵀ and scores·V) are not in the list, so under eager they are recomputed; add
# "aten.bmm" to policy.save_ops to keep them (and the B·H·T² scores they make).
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

    def __post_init__(self) -> None:
        for name in self.save_ops:
            if _packet(name) is None:
                raise ValueError(f"policy.save_ops: unknown op {name!r}; write it as 'aten.mm' (namespace.op)")


def _packet(name: str) -> Any:
    """An op name ('aten.mm', 'aten.mm.default') as its op packet, or None."""
    ns, _, op = str(name).partition(".")
    try:
        return getattr(getattr(torch.ops, ns), op.split(".")[0]) if ns and op else None
    except (AttributeError, RuntimeError):
        return None


def resolve_ops(names: Iterable[str]) -> frozenset[Any]:
    """Op names to op packets (validated by OpSacConfig); every overload of a named packet matches."""
    return frozenset(_packet(name) for name in names)


@register
class OpLevelSAC(Policy):
    """Per-op selective activation checkpointing (torch's SAC contexts) on every block."""

    name = "op_sac"
    caps = Capabilities(treatment=True, recomputes=True)
    Config = OpSacConfig

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__(cfg)
        # Made here, not in a functools.cached_property: on Python 3.11 its first read takes an RLock, which dynamo
        # cannot trace, so under trainer.compile=true each block's checkpoint broke the graph.
        self.context_fn = self._contexts()

    def _contexts(self) -> Callable[[], Any]:
        save = resolve_ops(self.cfg.save_ops)

        def decide(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            count_sac_decision()  # the step-time model costs each decision (trainer.measure.time.roofline)
            packet = getattr(op, "overloadpacket", op)
            return CheckpointPolicy.MUST_SAVE if packet in save else CheckpointPolicy.PREFER_RECOMPUTE

        if list(self.cfg.save_ops) == DEFAULT_SAC_SAVE_OPS:  # checked exact on every family: no guard's overhead
            return functools.partial(create_selective_checkpoint_contexts, decide)

        # a list of the user's own (aten.bmm, say) may save what a model then writes into
        return functools.partial(SavedOutputGuard.contexts, self.name, decide)

    def run(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, key: int) -> torch.Tensor:
        return checkpointed(fn, x, context_fn=self.context_fn)


class SavedOutputGuard(TorchDispatchMode):
    """Refuses, in one line, a forward that writes in place into an output the SAC cache saved.

    torch's SAC hands the cached output back in the recompute as it is *then*; its version check misses a write
    made through `aten._unsafe_view` (how a ≥3-D matmul returns bmm's or mm's output), so a model that scales
    the scores in place (Falcon: `scores /= sqrt(d)` after `q @ kᵀ`) would get silently wrong gradients from a
    policy that saves aten.bmm. Entered inside SAC's own forward mode, so it sees each op first and SAC's decision
    for it just after (`last`, set by the policy function `contexts` wraps)."""

    def __init__(self, policy: str) -> None:
        super().__init__()
        self.policy, self.saved, self.last = policy, set[int](), CheckpointPolicy.PREFER_RECOMPUTE

    @classmethod
    def contexts(cls, policy: str, decide: Callable[..., CheckpointPolicy]) -> tuple[Any, Any]:
        """torch's selective-checkpoint contexts for `decide`, the forward's with a fresh guard inside: a
        context_fn's answer for one checkpoint call. Under torch.compile the region is traced functionally (no write
        into a saved output survives) and dynamo accepts only the two modes themselves: no guard there."""
        if torch.compiler.is_compiling():
            return create_selective_checkpoint_contexts(decide)
        guard = cls(policy)

        def decided(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            guard.last = decide(ctx, func, *args, **kwargs)
            return guard.last

        forward, recompute = create_selective_checkpoint_contexts(decided)
        return _entered_together(forward, guard), recompute

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        schema = getattr(func, "_schema", None)
        if schema is not None and self.saved:
            for arg, value in zip(schema.arguments, args, strict=False):
                written = arg.alias_info is not None and arg.alias_info.is_write
                if written and isinstance(value, torch.Tensor) and _storage(value) in self.saved:
                    raise PolicyError(
                        f"policy={self.policy}: this model writes in place ({func}) into the output of an op the "
                        "policy saves, which torch's selective checkpoint would hand back mutated in the recompute "
                        "(wrong gradients); use op_sac with its default save_ops, or full"
                    )
        self.last = CheckpointPolicy.PREFER_RECOMPUTE
        out = func(*args, **kwargs)
        if self.last == CheckpointPolicy.MUST_SAVE:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and _storage(t):  # 0: nothing to compare (a fake tensor)
                    self.saved.add(_storage(t))
        return out


def _storage(t: torch.Tensor) -> int:
    """Where a tensor's bytes live; 0 where it has none to compare (a fake tensor: the estimator trusts the run)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(t, FakeTensor):  # its data pointer is meaningless (and torch warns on reading it)
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return 0


@contextlib.contextmanager
def _entered_together(outer: Any, inner: Any) -> Iterator[None]:
    with outer, inner:
        yield


def _ops(*names: str) -> frozenset[Any]:
    """Ops by dotted name under torch.ops (or torch._higher_order_ops: "hop.<name>"), skipping those this torch
    lacks, as torchtitan does; each skipped name is said once (logged at INFO), not dropped without a word."""
    out = set()
    for name in names:
        obj: Any = torch.ops
        path = name
        if name.startswith("hop."):
            obj, path = torch._higher_order_ops, name.removeprefix("hop.")
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            _say_missing(name)
            continue
        out.add(obj)
    return frozenset(out)


_MISSING: set[str] = set()


def _say_missing(name: str) -> None:
    if name not in _MISSING:
        _MISSING.add(name)
        log.info("torchtitan's save list names %s, which this torch %s lacks: not saved", name, torch.__version__)


def torchtitan_save_ops(version: str) -> frozenset[Any]:
    """What torchtitan's per-op policy saves. 0.3 (main): `_get_default_save_ops`, the min-cut partitioner's
    compute-intensive ops, the SDPA kernels it names, max, linear, topk and the collectives. 0.2: the llama3
    `_op_sac_save_list`."""
    if version == "0.2":
        return _ops(
            "aten.mm.default",
            "aten._scaled_dot_product_efficient_attention.default",
            "aten._scaled_dot_product_flash_attention.default",
            "aten._scaled_dot_product_cudnn_attention.default",
            "aten._scaled_dot_product_attention_math.default",
            "aten._scaled_dot_product_fused_attention_overrideable.default",
            "_c10d_functional.reduce_scatter_tensor.default",
            "aten.max.default",
            "hop.flex_attention",
            "torch_attn._varlen_attn.default",
            "hop.inductor_compiled_code",
        )
    from torch._functorch.partitioners import get_default_op_list

    return frozenset(op.default for op in get_default_op_list().compute_intensive_ops) | _ops(
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_attention_math.default",
        "aten._scaled_dot_product_fused_attention_overrideable.default",
        "aten.max.default",
        "aten.linear.default",
        "aten.topk.default",
        "_c10d_functional.reduce_scatter_tensor.default",
        "_c10d_functional.all_to_all_single.default",
        "hop.flex_attention",
        "hop.inductor_compiled_code",
        "torch_attn._varlen_attn.default",
    )


TORCHTITAN_VERSIONS = ("0.3", "0.2")


@dataclass
class TorchtitanSacConfig(PolicyConfig):
    # 0.3: torchtitan main's SelectiveAC (aten.mm and aten.linear counted); 0.2: 0.2.x's `selective_ac_option =
    # "op"` (aten.mm counted). The two save lists differ (torchtitan_save_ops).
    version: str = "0.3"

    def __post_init__(self) -> None:
        if self.version not in TORCHTITAN_VERSIONS:
            raise ValueError(f"policy.version={self.version!r}; choose {' or '.join(TORCHTITAN_VERSIONS)}")


@register
class TorchtitanSAC(Policy):
    """torchtitan's per-op policy on every block, decided as its `_wrap_block` decides: save the listed ops' outputs
    except every second matmul (counted apart in the forward and in the recompute, afresh per checkpoint call, as
    its context_fn makes), recompute the rest. Written here rather than imported because torchtitan wraps modules
    (checkpoint_wrapper) where the project installs plans through the decoder contract; a test holds its decisions
    equal to torchtitan's own, op by op."""

    name = "torchtitan_sac"
    caps = Capabilities(treatment=True, recomputes=True)
    Config = TorchtitanSacConfig

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__(cfg)
        self.save = torchtitan_save_ops(self.cfg.version)
        self.context_fn = self._contexts()  # made here: see OpLevelSAC.__init__

    @property
    def counted(self) -> tuple[Any, ...]:
        mm = torch.ops.aten.mm.default
        return (mm,) if self.cfg.version == "0.2" else (mm, torch.ops.aten.linear.default)

    def _contexts(self) -> Callable[[], tuple[Any, Any]]:
        """A plain function, not a bound method: dynamo calls a checkpoint's context_fn unbound when it traces it
        (trainer.compile=true), so a method would lose its `self`."""
        save, counted, name = self.save, self.counted, self.name

        def contexts() -> tuple[Any, Any]:
            return SavedOutputGuard.contexts(name, _alternate_matmuls(save, counted))

        return contexts

    def run(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, key: int) -> torch.Tensor:
        return checkpointed(fn, x, context_fn=self.context_fn)


def _alternate_matmuls(save: frozenset[Any], counted: tuple[Any, ...]) -> Callable[..., CheckpointPolicy]:
    """torchtitan's decision for one checkpoint call: save the listed ops except every second counted matmul, counted
    apart in the forward and in the recompute."""
    count = {"forward": 0, "recompute": 0}

    def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        count_sac_decision()  # the step-time model costs each decision (trainer.measure.time.roofline)
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in counted:
            count[mode] += 1
        if func in save and not (func in counted and count[mode] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return decide


@register
class FullRecompute(Policy):
    """Checkpoint every block: only each block's input (the residual stream) is kept; +1 forward of compute."""

    name = "full"
    caps = Capabilities(treatment=True, recomputes=True)

    def run(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, key: int) -> torch.Tensor:
        return checkpointed(fn, x)


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
class FirstK(_KPolicy):
    """Megatron `recompute_method=block`: checkpoint each of the first `k` blocks, store the rest."""

    name = "first_k"

    def plan(self, n_layer: int) -> Plan:
        return Plan.per_block(["full"] * self.cfg.k + ["none"] * (n_layer - self.cfg.k))


@register
class EveryK(_KPolicy):
    """Megatron `recompute_method=uniform`: groups of `k` consecutive blocks, one checkpoint per group."""

    name = "every_k"

    def plan(self, n_layer: int) -> Plan:
        return Plan.groups(n_layer, self.cfg.k, "full")


def ceil_sqrt(n: int) -> int:
    return math.isqrt(n - 1) + 1 if n > 0 else 0


@register
class SqrtGroups(Policy):
    """Chen et al. 2016: ⌈√L⌉ groups of consecutive blocks, one checkpoint per group.

    Keeps √L group inputs, but recomputing a group holds all its blocks' internals at once; a transformer
    block's internals dwarf its input, so this can peak ABOVE `full` (the tests show it, measured).
    """

    name = "sqrt"

    def plan(self, n_layer: int) -> Plan:
        return Plan.groups(n_layer, -(-n_layer // ceil_sqrt(n_layer)), "full")


@dataclass
class OffloadConfig(PolicyConfig):
    min_bytes: int = 1 << 16  # smaller tensors stay on the device: a copy costs more than the bytes it frees
    prefetch: bool = True  # in backward, bring the previous block's tensors back while this block computes

    def __post_init__(self) -> None:
        if self.min_bytes < 0:
            raise ValueError(f"policy.min_bytes={self.min_bytes} must be ≥ 0")


@register
class Offload(Policy):
    """Keep every block's activations in pinned host memory, copied on side CUDA streams with prefetch."""

    name = "offload"
    caps = Capabilities(treatment=True)
    Config = OffloadConfig

    def check(self, n_layer: int, attention: str) -> None:
        if not torch.cuda.is_available():
            say_once(
                "policy=offload without a CUDA device: activations are already in host memory, "
                "so the move is a no-op (gradients are unchanged)"
            )

    def unavailable(self, attention: str, device_type: str) -> str | None:
        return None if device_type == "cuda" else "without a CUDA device it is `none`"

    @functools.cached_property
    def offloader(self) -> ActivationOffloader:
        return ActivationOffloader(self.cfg.min_bytes, self.cfg.prefetch)

    def run(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, key: int) -> torch.Tensor:
        return self.offloader.run(key, fn, x)


@dataclass
class MemoryBudgetConfig(PolicyConfig):
    # torch._functorch.config.activation_memory_budget: the share of the default cut's saved bytes the partitioner
    # may keep (0: recompute everything the graph allows, 1: the default runtime-optimised cut).
    budget: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.budget <= 1.0:
            raise ValueError(f"policy.budget={self.budget} must be in [0, 1]")


@register
class MemoryBudget(Policy):
    """torch's own budget partitioner: AOTAutograd's min-cut under `activation_memory_budget` (torchtitan's
    `memory-budget` AC mode) decides, over the whole compiled graph, what is saved and what recomputed. The blocks
    run as under `none`; the policy only sets the budget while the model compiles, so it needs trainer.compile=true.

    Below budget 1 the partitioner may recompute a dropout with fresh randomness (pytorch issues 190717, 190758:
    silently wrong gradients), and this torch does (tests/test_compiled.py reproduces it), so a model that draws
    dropout is refused there."""

    name = "memory_budget"
    Config = MemoryBudgetConfig
    caps = Capabilities(requires_compile=True)

    def plan(self, n_layer: int) -> Plan:
        return Plan.uniform(n_layer, "none")

    def refusal(self, compiled: bool, dropout: bool) -> str | None:
        if (why := super().refusal(compiled, dropout)) is not None:
            return why
        if dropout and self.cfg.budget < 1.0:
            return (
                f"policy memory_budget: policy.budget={self.cfg.budget} with dropout on: below 1 torch's partitioner "
                "may recompute dropout with fresh randomness (pytorch issues 190717, 190758: wrong gradients); set "
                "model.dropout=0 or policy.budget=1"
            )
        return None

    def compile_backend(self, inner_compile: Any = None) -> Any:
        return budget_backend(float(self.cfg.budget), inner_compile)


def budget_backend(budget: float, inner_compile: Any = None) -> Callable[..., Any]:
    """inductor, with AOTAutograd's partitioner under `activation_memory_budget=budget` while it compiles a graph.

    A backend of its own rather than the config patched around the model's calls: dynamo keys compiled code by
    backend, not by functorch's config, so two modules with different budgets in one process would share the first
    one's cut."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        import torch._functorch.config as functorch_config

        with functorch_config.patch(activation_memory_budget=budget):
            if inner_compile is None:
                return compile_fx(gm, example_inputs)
            return compile_fx(gm, example_inputs, inner_compile=inner_compile)

    return backend


def draws_dropout(model: torch.nn.Module) -> bool:
    """Does the model draw a dropout mask in training: a dropout module with p > 0, or an attention that keeps its
    probability as a number (HF attention classes: `attention_dropout`, passed to SDPA)?"""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        for key in ("attention_dropout", "dropout_p", "attn_dropout_p"):
            value = getattr(m, key, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                return True
    return False


@dataclass
class PerBlockConfig(CompositeConfig):
    blocks: list[str] = field(default_factory=list)  # one treatment per block, e.g. [full, full, offload, none]
    pattern: list[str] = field(default_factory=list)  # repeated to cover the blocks, e.g. [full, none]

    def __post_init__(self) -> None:
        # `blocks` wins when given, so `policy.blocks=[...]` works on top of the yaml's default pattern.
        if not self.blocks and not self.pattern:
            raise ValueError("give policy.blocks=[...] (one treatment per block) or policy.pattern=[...] (repeated)")
        check_treatments(self.blocks or self.pattern, "blocks" if self.blocks else "pattern")


@register
class PerBlock(Policy):
    """A treatment per block: the building block of the memory-budget planner."""

    name = "per_block"
    Config = PerBlockConfig

    def block_treatments(self, n_layer: int) -> list[str]:
        if self.cfg.blocks:
            return list(self.cfg.blocks)
        return [self.cfg.pattern[i % len(self.cfg.pattern)] for i in range(n_layer)]

    def check(self, n_layer: int, attention: str) -> None:
        if self.cfg.blocks and len(self.cfg.blocks) != n_layer:
            raise PolicyError(
                f"policy per_block: policy.blocks has {len(self.cfg.blocks)} entries but the model "
                f"has {n_layer} blocks; give one treatment per block"
            )
        for t in dict.fromkeys(self.block_treatments(n_layer)):
            self.treatment_policy(t).check(n_layer, attention)

    def plan(self, n_layer: int) -> Plan:
        return Plan.per_block(self.block_treatments(n_layer))


@dataclass
class AutoConfig(CompositeConfig):
    """policy=auto: the fastest per-block plan whose predicted whole-step peak fits the budget (trainer/planner/).

    The budget bounds the step's whole peak as the run reports it (`peak_total_mib`: the CUDA allocator's peak, or
    the live-tensor tracker's on CPU). Give exactly one of budget_mib, budget_gb (10^9 bytes) or budget_fraction
    (of the CUDA device's total memory).
    """

    budget_mib: float | None = None
    budget_gb: float | None = None
    budget_fraction: float | None = None
    allow_accum: bool = False  # nothing fits: halve the micro-batch, double accum (same tokens per step), retry
    profile_repeats: int = 5  # timed rounds per block and treatment, interleaved across treatments (median)
    profile_warmup: int = 1  # untimed rounds before them
    # The treatments the planner chooses from; null: every registered treatment. offload is used only where there
    # is a CUDA device (elsewhere it is `none`), selective only with eager attention.
    candidates: list[str] | None = None
    # The loss heads the planner may pick (conf/loss/): the configured one first; null: the configured one only.
    loss_candidates: list[str] | None = field(default_factory=lambda: ["chunked"])

    BUDGET_KEYS = ("budget_mib", "budget_gb", "budget_fraction")

    @property
    def budgets_given(self) -> list[str]:
        return [k for k in self.BUDGET_KEYS if getattr(self, k) is not None]

    def __post_init__(self) -> None:
        given = self.budgets_given
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
        if self.profile_warmup < 0:
            raise ValueError(f"policy.profile_warmup={self.profile_warmup} must be ≥ 0")
        unknown = [n for n in self.loss_candidates or [] if n not in LOSSES]
        if unknown:
            raise ValueError(
                f"policy.loss_candidates: unknown loss head {unknown[0]!r}; choose from {', '.join(LOSSES)}"
            )
        if self.candidates is not None:
            if not self.candidates:
                raise ValueError(f"policy.candidates is empty; list some of {', '.join(treatments())} (or null)")
            check_treatments(self.candidates, "candidates")

    @property
    def treatment_candidates(self) -> list[str]:
        return list(self.candidates) if self.candidates is not None else list(treatments())


@register
class Auto(Policy):
    """The memory-budget planner's policy: a per-block plan chosen at fit start by the callback it brings
    (`brings`: callbacks.planner's AutoPlanCallback).

    `plan()` installs the chosen treatments (`choose`); before a choice is made it checkpoints every block (`full`,
    the frugal default), so a model used without the planning callback never exceeds what `full` needs.
    """

    name = "auto"
    Config = AutoConfig
    caps = Capabilities(
        planned_first=True,
        unplanned="needs a budget (policy=auto policy.budget_mib=…) to plan",
        brings=("callbacks.planner:AutoPlanCallback",),
    )
    chosen: tuple[str, ...] | None = None  # the planner's treatments, one per block

    def choose(self, block_treatments: Iterable[str]) -> None:
        chosen = tuple(block_treatments)
        check = [t for t in chosen if t not in treatments()]
        if check:
            raise PolicyError(f"policy auto: unknown treatment {check[0]!r}")
        self.chosen = chosen

    def check(self, n_layer: int, attention: str) -> None:
        if not self.cfg.budgets_given:
            raise PolicyError(
                "policy auto needs a budget: give one of policy.budget_mib=…, policy.budget_gb=… or "
                "policy.budget_fraction=… (of the CUDA device's memory)"
            )
        if self.cfg.budget_fraction is not None and not torch.cuda.is_available():
            raise PolicyError(
                f"policy auto: policy.budget_fraction={self.cfg.budget_fraction} is a fraction of a CUDA device's "
                "memory and there is none here; give policy.budget_mib=… instead"
            )
        if self.chosen is not None and len(self.chosen) != n_layer:
            raise PolicyError(f"policy auto: the chosen plan has {len(self.chosen)} blocks, the model {n_layer}")

    def plan(self, n_layer: int) -> Plan:
        return Plan.per_block(self.chosen if self.chosen is not None else ["full"] * n_layer)


__all__ = [
    "DEFAULT_SAC_SAVE_OPS",
    "Auto",
    "AutoConfig",
    "EveryK",
    "FirstK",
    "FullRecompute",
    "KConfig",
    "MemoryBudget",
    "MemoryBudgetConfig",
    "budget_backend",
    "NoRecompute",
    "Offload",
    "OffloadConfig",
    "OpLevelSAC",
    "OpSacConfig",
    "PerBlock",
    "PerBlockConfig",
    "SelectiveRecompute",
    "SqrtGroups",
    "TORCHTITAN_VERSIONS",
    "TorchtitanSAC",
    "TorchtitanSacConfig",
    "ceil_sqrt",
    "draws_dropout",
    "torchtitan_save_ops",
    "resolve_ops",
]
