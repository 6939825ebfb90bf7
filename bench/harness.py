"""What every benchmark measures with: the run's DecoderModule, optimizer, precision plugin and StepMeter, stepped by
`trainer.core.step.bare_step` (nothing here is a second definition of the step) on a fixed batch of random tokens.

    h = Harness(bench_config(["model=tiny"], "cpu")[0], "cpu")  # the module seeded as a run seeds it, AdamW, plugin
    h.warm(); h.measure(variant) -> Figures; h.timed(variant) -> seconds   # StepMeter + count_flops; one timed step
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from bench.common import BenchError, environment, sync
from trainer import estimate
from trainer.core import build
from trainer.core.module import DecoderModule, param_groups
from trainer.core.schema import Config, compose_config, describe_user_error
from trainer.core.step import StepMeter, bare_step, optimizers_of
from trainer.estimate.tables import quiet_policy_notices
from trainer.formatting import MIB
from trainer.loss import LossConfig
from trainer.measure.time.flops import count_flops
from trainer.planner import default_optimizer, profile_model, smallest_budget_mib
from trainer.policies import POLICIES, Policy, PolicyError, apply_policy, build_policy
from trainer.precision import plugin


def bench_config(overrides: Sequence[str], device_type: str) -> tuple[Config, dict[str, Any]]:
    """train.py's config from `overrides`, with `precision` settled for this device as a run settles it (so the
    estimator and the measured step run the same precision), and the environment line of the tables. A config
    error is a one-line BenchError naming the overrides."""
    try:
        config = compose_config(list(overrides))
    except Exception as e:
        line = describe_user_error(e)
        if line is None:
            raise
        raise BenchError(f"{' '.join(overrides)}: {line}") from None
    env = environment(device_type, config.precision)
    config.precision = env["precision"]
    return config, env


def build_module(config: Config, policy: Any = "none") -> DecoderModule:
    """The run's LightningModule, initialised from `config.seed` as train.py initialises it (policy `none`: the
    benchmarks switch policies with `apply_policy`)."""
    torch.manual_seed(config.seed)
    return build.module(config, policy, hf_config=build.hf_config(config))


def random_batch(vocab: int, batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)


@dataclass
class Variant:
    """One thing a benchmark compares: a policy (built fresh for each module it runs on), a loss head and the
    micro-batch size (None: the configured one; smaller: the same tokens as more micro-batches per step)."""

    label: str
    make_policy: Callable[[], Policy]
    loss: LossConfig
    micro_batch: int | None = None

    @functools.cached_property
    def policy(self) -> Policy:
        return self.make_policy()


def registered_policies(
    config: Config, only: Sequence[str] | None = None, flag: str = ""
) -> tuple[dict[str, Callable[[], Policy]], dict[str, str]]:
    """Every registered policy (registration order) with its conf/policy/<name>.yaml parameters, or those named in
    `only` (by `flag`: one that cannot run is refused); a policy that cannot run from its conf on this model maps to
    its one-line reason instead."""
    with torch.device("meta"):  # the model's shape through the decoder contract, nothing allocated
        adapter = build_module(config).adapter
    unknown = [n for n in only or () if n not in POLICIES]
    if unknown:
        raise BenchError(f"unknown policy {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    runnable: dict[str, Callable[[], Policy]] = {}
    skipped: dict[str, str] = {}
    with quiet_policy_notices():
        for name in POLICIES if only is None else only:
            if POLICIES[name].caps.requires_compile and not config.trainer.compile:
                skipped[name] = "needs trainer.compile=true (torch's compile-time partitioner: bench.compiled runs it)"
                continue
            try:
                estimate.default_policy(name).check(adapter.n_layer, adapter.attention)
            except PolicyError as e:
                skipped[name] = str(e) + (" (bench.planner plans it across budgets)" if name == "auto" else "")
                continue
            runnable[name] = lambda name=name: estimate.default_policy(name)
    if flag and skipped:
        raise BenchError(f"{flag} {next(iter(skipped))}: {next(iter(skipped.values()))}")
    return runnable, skipped


class UncountedOps(TorchDispatchMode):
    """Ops outside aten/prims that FlopCounterMode has no formula for (a fused kernel's FLOPs it cannot see);
    `profiler` ops (record_function marks, e.g. the optimizer's) compute nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        packet = func._overloadpacket
        if func.namespace not in ("aten", "prims", "profiler") and packet not in flop_registry:
            self.names.add(str(packet))
        return func(*args, **(kwargs or {}))


@dataclass
class Figures:
    """One step's figures: StepMeter's (bytes) and count_flops' (forward + backward, recompute included)."""

    activation_bytes: int  # memory/activation_peak_mib
    total_bytes: int  # memory/peak_total_mib (the live-tensor tracker's, with the training state adopted)
    head_bytes: int  # the most the head (final norm, logits, loss; forward and backward) held at once
    flops: int
    uncounted_ops: list[str]
    cuda_peak_allocated_bytes: int | None = None  # CUDA: the allocator's peak over the metered step


class Harness:
    """One configuration's module, optimizer, scheduler, precision plugin and fixed batch on one device; built with
    `policy` (a name or config), the module is set up as a run's setup does it (compiled after its policy)."""

    def __init__(self, config: Config, device: str | torch.device, policy: Any = None) -> None:
        self.config = config
        self.device = torch.device(device)
        self.precision = config.precision
        if self.precision == "auto":
            raise BenchError("settle precision=auto first (bench_config)")
        self.plugin = plugin(self.precision, self.device.type)
        module = self.plugin.convert_module(build_module(config, policy or "none"))  # bf16-true: bf16 weights
        self.module = module.to(self.device).train()
        if policy is not None:
            self.module.configure_model()
        self.optimizer, self.scheduler = optimizers_of(self.module)
        self.vocab = int(self.module.adapter.head.weight.shape[0])
        self.batch = random_batch(self.vocab, config.batch_size * config.accum, config.seq_len, seed=0)

    def describe(self) -> str:
        c, d = self.config, self.module.adapter.describe()
        family = d["family"] if "model_type" not in d else f"{d['family']} {d['model_type']}"
        kv = f" ({d['n_kv_head']} key/value)" if d["n_kv_head"] != d["n_head"] else ""
        dropout = f", dropout {d['dropout']}" if "dropout" in d else ""
        return (
            f"`{c.model.name}` ({family}: L={d['n_layer']}, d={d['n_embd']}, {d['n_head']} heads{kv}, vocab "
            f"{d['vocab_size']}, {d['attention']} attention{dropout}, {d['params']:,} parameters); micro-batch "
            f"{c.batch_size}×{c.seq_len} tokens, accum {c.accum}"
        )

    def batches(self, micro_batch: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The fixed batch as the step's micro-batches, on the device."""
        mb = micro_batch or self.config.batch_size
        x, y = self.batch
        if x.shape[0] % mb:
            raise BenchError(f"micro-batch {mb} does not divide the batch of {x.shape[0]} sequences")
        to = {"device": self.device, "non_blocking": True}
        return [(x[i : i + mb].to(**to), y[i : i + mb].to(**to)) for i in range(0, x.shape[0], mb)]

    def use(self, variant: Variant) -> None:
        apply_policy(self.module.model, variant.policy)
        self.module.loss_config = variant.loss

    def step(self, variant: Variant | None = None, meter: StepMeter | None = None) -> None:
        batches = self.batches(None if variant is None else variant.micro_batch)
        clip, layers = self.config.trainer.grad_clip, list(self.module.adapter.layers)
        bare_step(self.module, batches, self.optimizer, self.scheduler, self.plugin, clip, meter=meter, layers=layers)

    def warm(self, steps: int = 1) -> None:
        """Steps before anything is measured: AdamW's state and last step's gradients then exist, as they do from
        a run's second step on."""
        for _ in range(steps):
            self.step()
        sync(self.device)

    def measure(self, variant: Variant) -> Figures:
        """Two untimed steps of `variant`: one under StepMeter (regions on, for the head's share), one counted."""
        self.use(variant)
        sync(self.device)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        torch.manual_seed(1)  # the same dropout masks for every variant
        meter = StepMeter(self.device.type, regions=True)
        self.step(variant, meter)
        sync(self.device)
        f = meter.end(self.module)
        cuda_peak = torch.cuda.max_memory_allocated(self.device) if cuda else None
        torch.manual_seed(1)
        with UncountedOps() as uncounted:
            flops = count_flops(lambda: self.step(variant))
        return Figures(f.activation_bytes, f.total_bytes, f.head_peak, flops, sorted(uncounted.names), cuda_peak)

    def planner_args(self, loss_fns: dict[str, Any] | None = None) -> dict[str, Any]:
        """The planner verbs' arguments besides the model, a micro-batch and the policy, as the planning callback
        passes them at fit start: the loss heads (default: the configured one), the run's AdamW and clipping."""
        wd = self.config.optim.weight_decay
        return {
            "loss_fns": loss_fns or {self.module.loss_config.name: self.module.loss_of},
            "precision": self.precision,
            "accum": self.config.accum,
            "make_optimizer": default_optimizer(wd),
            "param_groups": param_groups(self.module.model, wd),
            "grad_clip": self.config.trainer.grad_clip,
        }

    def profile(self, auto: Policy | None = None, loss_fns: dict[str, Any] | None = None) -> Any:
        """`trainer.planner.profile_model` of this module on its first micro-batch, as policy=auto's callback takes it
        at fit start (default: the uniform none, selective, op_sac and full, five repeats each)."""
        treatments = ["none", "selective", "op_sac", "full"]
        auto = auto or build_policy({"name": "auto", "budget_mib": 1, "candidates": treatments, "profile_repeats": 5})
        with quiet_policy_notices():
            return profile_model(self.module.model, self.batches()[0], auto, **self.planner_args(loss_fns))

    def timed(self, variant: Variant | None = None) -> float:
        if variant is not None:
            self.use(variant)
        sync(self.device)
        t0 = time.perf_counter()
        self.step(variant)
        sync(self.device)
        return time.perf_counter() - t0

    def interleaved(
        self, variants: dict[str, Variant], rounds: int, warmup: int = 0, between: Callable[[], None] | None = None
    ) -> dict[str, list[float]]:
        """Seconds per step of each variant: `warmup` untimed rounds, then `rounds`; in round r every variant runs
        one step, the order rotated by r, so slow drifts of a shared machine's load fall on all of them alike.
        `between` runs after each timed round (a prediction made in the same stretch of time as the steps)."""
        names = list(variants)
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(warmup + rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                seconds = self.timed(variants[name])
                if r >= warmup:
                    times[name].append(seconds)
            if between is not None and r >= warmup:
                between()
        return times


def estimated(session: estimate.Session, variant: Variant) -> estimate.Estimate:
    """The estimator's figures for `variant` (a policy object of its own: policies keep per-model state)."""
    with quiet_policy_notices():
        return estimate.measure(session, variant.make_policy(), variant.loss)


def budget_levels(peaks: Sequence[int], n: int) -> list[float]:
    """`n` memory budgets (MiB, as the planner words them) evenly spaced from the largest peak, rounded up so a plan
    of that peak fits it, down to 7 % below the smallest."""
    top, bottom = max(peaks), int(min(peaks) * 0.93)
    digits = 3 if top < 10 * MIB else 1
    budgets = [round((top - (top - bottom) * k / (n - 1)) / MIB, digits) for k in range(n)]
    budgets[0] = smallest_budget_mib(top)
    return budgets


def median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median over rounds of a's step over b's step in the same round."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def spread(values: Sequence[float]) -> float:
    """Half the interquartile range over the median: how far a typical step strays."""
    if len(values) < 4:
        return (max(values) - min(values)) / 2 / statistics.median(values)
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / 2 / statistics.median(values)
