"""Memory and FLOPs of a training configuration under every policy, before any GPU hour: the real model, run on
fake tensors.

    python -m trainer.estimate model=llama2-7b batch_size=8 seq_len=4096 policy=full --budget 80GB
    python -m trainer.estimate model=llama3-8b seq_len=8192 loss=chunked --json est.json
    python -m trainer.estimate policy=selective --device cuda

The same Hydra overrides as train.py compose the same config. The estimator builds the LightningModule exactly as a
run does (the model of any family, the policy installed through the decoder contract, the loss head, AdamW and its
schedule, the precision plugin's module conversion) inside `torch._subclasses.fake_tensor.FakeTensorMode`, so no
weight or activation is ever allocated, and runs one steady-state optimizer step as Lightning runs it
(`trainer.step.bare_step`: forward in Lightning's own precision context with last step's gradients alive, zero_grad,
backward, the numeric guard's norm, clipping, AdamW, the LR step) under the same `StepMeter` the measuring callback
uses. The two figures are therefore the two a run logs: `activation_bytes` = memory/activation_peak_mib and
`peak_bytes` = memory/peak_total_mib. FLOPs come from torch's FlopCounterMode over the same step.

Devices. The fake tensors live on the device the run would use: with a CUDA device visible, fake CUDA tensors run
CUDA's kernels, dropout masks and autocast rules. Without one (or with `--device cuda` on a CPU-only torch), the
figures follow the CPU kernels, translated for `--device cuda` by one stated rule per kernel whose bytes differ on
CUDA (see `CudaKernelRules`); what no rule translates is named in the output.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from trainer import precision as precision_
from trainer import step as step_
from trainer.loss import LOSSES, LossConfig
from trainer.policies import POLICIES, Plan, Policy, PolicyError, apply_policy, build_policy, resolve_plan
from trainer.rundir import write_json_atomic
from trainer.schema import Config, ConfigError, OneLineParser, model_vocab

MIB = 2**20
ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
log = logging.getLogger(__name__)

# What the CPU kernels cannot show about CUDA, when the estimate is translated (--device cuda on a CPU machine).
UNTRANSLATED_CUDA = (
    "LayerNorm keeps fp32 mean/rstd on CUDA (the input dtype on CPU; B·T values per norm)",
    "allocator rounding (512-byte blocks) and fragmentation, the CUDA context, cuBLAS/cuDNN workspaces",
)


class CudaKernelRules(contextlib.ContextDecorator):
    """The CPU run translated to CUDA's kernel choices, one rule per kernel whose saved bytes differ:

    * dropout: CUDA runs the fused `native_dropout`, keeping a 1-byte bool mask; CPU keeps a scaled noise tensor
      in the input dtype. Rule: call `torch.native_dropout` (it runs on CPU too, with the same outputs and mask).
    * scaled_dot_product_attention with dropout: CUDA's flash / memory-efficient kernels apply dropout inside the
      kernel (no T×T tensor); on CPU it falls back to the math path, which keeps fp32 T×T probabilities. Rule: run
      the CPU fused kernel (dropout_p=0), which keeps the same output and log-sum-exp the CUDA kernels keep.
    * softmax / log_softmax under autocast: CUDA autocast computes them in fp32 (its "fp32, set dtype" list);
      CPU autocast leaves them in bf16. Rule: pass dtype=float32 when autocast is on and the input is 16-bit.

    The rules replace those functions of torch.nn.functional for the fake run's duration (models look them up at
    call time). Not a TorchFunctionMode: torch does not carry the function-mode stack into a checkpoint's recompute
    in backward, so a recomputed region would run the CPU kernels and fail checkpoint's metadata check.
    """

    NAMES = ("dropout", "scaled_dot_product_attention", "softmax", "log_softmax")

    def __init__(self) -> None:
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> CudaKernelRules:
        self._saved = {n: getattr(F, n) for n in self.NAMES}
        dropout, sdpa = self._saved["dropout"], self._saved["scaled_dot_product_attention"]

        def rule_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
            if training and p > 0:
                return torch.native_dropout(input, p, True)[0]
            return dropout(input, p, training, inplace)

        def rule_sdpa(*args: Any, **kwargs: Any) -> Any:
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            kwargs.pop("dropout_p", None)
            return sdpa(*args, **kwargs)

        def fp32_on_autocast(fn: Callable[..., Any]) -> Callable[..., Any]:
            def rule(input: torch.Tensor, dim: Any = None, _stacklevel: int = 3, dtype: Any = None) -> Any:
                if (
                    dtype is None
                    and input.dtype in (torch.bfloat16, torch.float16)
                    and torch.is_autocast_enabled(input.device.type)
                ):
                    dtype = torch.float32
                return fn(input, dim=dim, dtype=dtype)

            return rule

        F.dropout = rule_dropout
        F.scaled_dot_product_attention = rule_sdpa
        F.softmax = fp32_on_autocast(self._saved["softmax"])
        F.log_softmax = fp32_on_autocast(self._saved["log_softmax"])
        return self

    def __exit__(self, *exc: Any) -> None:
        for n, fn in self._saved.items():
            setattr(F, n, fn)
        self._saved = {}


@dataclass
class Estimate:
    """One configuration under one policy and loss head, on one device. FLOPs are per optimizer step.

    `activation_bytes`: the activation peak of the step's first micro-batch (memory/activation_peak_mib: live
    tensors of its forward and backward, parameter gradients and the training state left out). `peak_bytes`: the
    step's whole peak (memory/peak_total_mib), steady state. `breakdown`: what was alive at the activation peak, by
    what made it ("layer i" forward, "head", "backward", ...); `at_step_peak`: the same at the step's peak, with the
    training state; `kept_per_layer`: what each layer's forward leaves for its backward (its output included, its
    input not: the previous layer's).
    """

    policy: str
    plan: str
    loss: str
    device: str
    precision: str
    activation_bytes: int
    peak_bytes: int
    components: dict[str, int]
    breakdown: dict[str, int]
    at_step_peak: dict[str, int]
    kept_per_layer: list[int]
    head_bytes: int  # the most bytes the head (final norm, logits, loss; forward and backward) held at once
    fwd_flops: int
    bwd_flops: int  # the recompute included (a checkpointed forward runs again inside the backward)
    peak_at: str = ""
    micro_batches: int = 1
    notes: list[str] = field(default_factory=list)

    @property
    def flops(self) -> int:
        return self.fwd_flops + self.bwd_flops

    def fits(self, budget_bytes: int | None) -> bool | None:
        return None if budget_bytes is None else self.peak_bytes <= budget_bytes

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "flops": self.flops}


# ----------------------------------------------------------------------------------------------------
# The fake run.
# ----------------------------------------------------------------------------------------------------


@dataclass
class Session:
    """The module, optimizer and batches of one configuration, built on fake tensors and stepped once (so the
    measured step has last step's gradients and the optimizer state, as in steady state)."""

    config: Config
    device: str  # what the estimate is for: cpu | cuda
    precision: str
    module: Any
    optimizer: Any
    scheduler: Any
    plugin: Any
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    fake: Any
    rules: Any
    notes: list[str]
    world: int = 1  # data-parallel ranks (trainer=fsdp2): the figures are one rank's

    def close(self) -> None:
        """Leave the fake process group of an FSDP2 estimate (a later estimate, or a run, may make its own)."""
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with _one_line_when_unrunnable(), self.fake, self.rules, _real_semantics(self.config):
            yield

    def step(self, meter: step_.StepMeter | None = None, on_forward: Callable[[], None] | None = None) -> None:
        step_.bare_step(
            self.module,
            self.batches,
            self.optimizer,
            self.scheduler,
            self.plugin,
            grad_clip=self.config.trainer.grad_clip,
            meter=meter,
            layers=list(self.module.adapter.layers),
            on_forward=on_forward,
        )


@contextlib.contextmanager
def _real_semantics(config: Config) -> Iterator[None]:
    """Rules for fake tensors that differ from the real run: CPU kernels whose fake output torch gets wrong (the MoE
    grouped matmul: trainer/fake_kernels.py), and a library's own (models/hf.py: as_on_real_tensors)."""
    from trainer.fake_kernels import cpu_kernel_rules

    with contextlib.ExitStack() as stack:
        stack.enter_context(cpu_kernel_rules())
        if config.model.family == "hf":
            from models.hf import as_on_real_tensors

            stack.enter_context(as_on_real_tensors())
        yield


@contextlib.contextmanager
def _one_line_when_unrunnable() -> Iterator[None]:
    """What fake tensors cannot run, as one line that names the op and the model code that called it: an op whose
    output shape or Python-read value depends on the data (e.g. an MoE layer's eager loop over the experts a batch
    routed to, rather than transformers' default grouped matmul), or one with no fake kernel."""
    from torch._subclasses import fake_tensor as ft

    try:
        yield
    except (ft.DynamicOutputShapeException, ft.DataDependentOutputException, ft.UnsupportedOperatorException) as e:
        why = {
            ft.DynamicOutputShapeException: "its output's shape depends on tensor values, which fake tensors lack",
            ft.DataDependentOutputException: "it reads a tensor's value in Python, which fake tensors lack",
        }.get(type(e), "torch has no fake (meta) kernel for it")
        torch_dir, here = Path(torch.__file__).parent, Path(__file__).parent
        where = "the model"
        tb = e.__traceback__
        while tb is not None:  # the innermost frame outside torch and the trainer: the model's own code
            path = Path(tb.tb_frame.f_code.co_filename)
            if not (path.is_relative_to(torch_dir) or path.parent == here):
                where = f"{tb.tb_frame.f_code.co_qualname} ({path.name}:{tb.tb_lineno})"
            tb = tb.tb_next
        raise ConfigError(f"cannot estimate this model on fake tensors: {e.func} in {where}, because {why}") from None


def estimate_device(config: Config, device: str | None) -> str:
    if device is not None:
        return device
    accel = config.trainer.accelerator
    if accel in ("gpu", "cuda"):
        return "cuda"
    return "cuda" if accel == "auto" and torch.cuda.is_available() else "cpu"


class _CachedAutocast:
    """--autocast-cache: a bare loop's default torch.autocast (weight cache on) instead of Lightning's (off)."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin

    def forward_context(self) -> Any:
        p = self.plugin
        return torch.autocast(p.device, dtype=torch.bfloat16 if p.precision == "bf16-mixed" else torch.half)

    def convert_module(self, module: Any) -> Any:
        return self.plugin.convert_module(module)


def open_session(config: Config, device: str | None = None, autocast_cache: bool = False) -> Session:
    """Build the configured module on fake tensors of the estimate's device, and step it once."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainer.module import DecoderModule

    device = estimate_device(config, device)
    notes: list[str] = []
    if device == "cuda" and not torch.cuda.is_available():
        chosen = "bf16-mixed" if config.precision == "auto" else config.precision
        if config.precision == "auto":
            notes.append("precision=auto → bf16-mixed: no CUDA device here to ask, so a GPU with bf16 (Ampere or "
                         "newer) is assumed; precision=16-mixed or 32-true estimates others")  # fmt: skip
    else:
        chosen, why = precision_.resolve(config.precision, device)
        if config.precision == "auto":
            notes.append(why + " (as train.py chooses on this machine)")
    if chosen == "16-mixed" and device != "cuda":
        raise ConfigError("precision=16-mixed needs a CUDA GPU; estimate it with --device cuda")
    fake_device = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    rules: Any = contextlib.nullcontext()
    if device == "cuda" and fake_device == "cpu":
        rules = CudaKernelRules()
        notes.append(
            "figures follow the CPU kernels (no CUDA device visible to this torch), translated to CUDA's kernels by "
            "one rule each: 1-byte dropout masks, fused attention with dropout, fp32 softmax under autocast; "
            "not translated: " + "; ".join(UNTRANSLATED_CUDA)
        )
    elif fake_device == "cpu":
        notes.append("figures follow the CPU kernels (device cpu); --device cuda translates them to CUDA's")
    hf_config = None
    if config.model.family == "hf":
        from models.hf import load_config

        hf_config = load_config(str(config.model.name_or_path))
    from trainer.data import check_config

    tokenizer_from = config.model.name_or_path if config.data.tokenizer == "model" else None
    check_config(config.data, config.seq_len, config.batch_size, tokenizer_from)  # the run's refusals, no data read
    vocab = model_vocab(config)
    if config.model.vocab_size is None and config.model.family != "hf":
        notes.append(f"vocab_size {vocab} from data.tokenizer={config.data.tokenizer} (model.vocab_size overrides it)")
    world = sharded_world(config)
    mesh = _fake_mesh(world, fake_device) if world > 1 else None
    if mesh is not None:
        notes.append(
            f"trainer=fsdp2: one rank of {world} (a fake process group): parameters, gradients and AdamW state "
            f"sharded {world} ways (FSDP2 per layer, then the root), each layer's all-gather buffers, the same "
            "activations, a micro-batch per rank"
        )
    elif config.trainer.strategy == "ddp":
        notes.append("trainer=ddp: one rank, without DDP's gradient buckets (a further copy of the gradients)")
    fake = FakeTensorMode()
    plugin = precision_.plugin(chosen, fake_device)
    if autocast_cache and chosen.endswith("-mixed"):
        plugin = _CachedAutocast(plugin)
        notes.append("autocast weight cache on (--autocast-cache): a bare loop's default torch.autocast; train.py "
                     "runs Lightning's, with it off")  # fmt: skip
    elif chosen.endswith("-mixed"):
        notes.append("autocast weight cache off, as train.py runs it (Lightning's MixedPrecision)")
    if getattr(plugin, "scaler", None) is not None:
        plugin.scaler = None  # its step reads found_inf with .item(), which a fake tensor has no value for
        notes.append("precision=16-mixed: GradScaler's scale and inf-check scalars (a few bytes) left out")
    with fake, rules, _real_semantics(config), torch.device(fake_device):
        torch.manual_seed(config.seed)
        module = DecoderModule(
            config.model,
            "none",
            config.optim,
            max_steps=config.trainer.max_steps,
            loss=config.loss,
            vocab_size=vocab,
            hf_config=hf_config,
        )
        dtype = precision_.param_dtype(chosen)
        if dtype != torch.float32:
            _to_dtype(module, dtype)  # what the plugin's convert_module (module.to(dtype)) does
        if mesh is not None:  # what Lightning's ModelParallelStrategy does with the module: its configure_model
            module._device_mesh = mesh
            module.configure_model()
        module.train()
        optimizer, scheduler = step_.optimizers_of(module)
        v = module.adapter.head.weight.shape[0]
        shape = (config.batch_size, config.seq_len)
        batches = [(torch.randint(0, v, shape), torch.randint(0, v, shape)) for _ in range(config.accum)]
    session = Session(config, device, chosen, module, optimizer, scheduler, plugin, batches, fake, rules, notes, world)
    with session.active():
        # Last step's gradients and AdamW's state, as a step leaves them (their bytes, not their values, matter).
        for p in module.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        optimizer.step()
    notes.append(
        "a steady-state step as train.py runs it: forward with last step's gradients alive, zero_grad, backward, "
        "clip, AdamW.step() (the first step peaks lower)"
    )
    return session


def sharded_world(config: Config) -> int:
    """The data-parallel ranks FSDP2 shards over (trainer.strategy=fsdp2), else 1."""
    t = config.trainer
    if t.strategy != "fsdp2":
        return 1
    if not isinstance(t.devices, int) or t.devices < 1:
        raise ConfigError(f"trainer.strategy=fsdp2 needs a device count, e.g. trainer.devices=2 (got {t.devices})")
    return t.devices * t.num_nodes


def _fake_mesh(world: int, device_type: str) -> Any:
    """A device mesh over `world` ranks of torch's fake process group (collectives that move nothing), as rank 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if torch.distributed.is_initialized():
        raise ConfigError("trainer=fsdp2 estimate: a process group is already initialised in this process")
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    return init_device_mesh(device_type, (world,), mesh_dim_names=("data_parallel",))


def _to_dtype(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """`module.to(dtype)` for a module of fake tensors. nn.Module._apply swaps a tensor subclass's payload in place,
    which fake tensors refuse (their mode holds weak references to them); this assigns converted parameters (ties
    kept) and buffers instead, which is the same result."""
    converted: dict[int, torch.nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_floating_point():
                continue
            if id(p) not in converted:
                converted[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            m._parameters[name] = converted[id(p)]
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_floating_point():
                m._buffers[name] = b.to(dtype)


def measure(session: Session, policy: Policy, loss: LossConfig | None = None) -> Estimate:
    """`policy` (and `loss`, else the configured head) on the session's module: one step, its figures."""
    from trainer.flops import FlopTally

    module = session.module
    configured_loss = module.loss_config
    if loss is not None:
        module.loss_config = loss
    try:
        with session.active():
            apply_policy(module.model, policy)
            plan = module.model.activation_plan
            meter = step_.StepMeter(device_type=None, regions=True)
            counter = FlopTally()
            forward: dict[str, int] = {}
            with counter:
                session.step(meter, on_forward=lambda: forward.setdefault("flops", counter.total))
                figures = meter.end(module)  # before the counter's mode, which lies beneath the tracker
    finally:
        module.loss_config = configured_loss
    components = _components(session, figures)
    accum = session.config.accum
    notes = list(session.notes)
    if (loss or configured_loss).name == "fused":
        notes.append("loss=fused is one op to the tracker: its per-chunk workspace inside (≈ chunk_tokens × vocab × "
                     "4 B) is not counted (trainer/loss.py)")  # fmt: skip
    total_flops = counter.total
    fwd = forward.get("flops", 0) * accum
    layers = [figures.after_forward.get(f"layer {i}", 0) for i in range(module.adapter.n_layer)]
    return Estimate(
        policy=policy.cfg.name,
        plan=plan.describe(),
        loss=(loss or configured_loss).name,
        device=session.device,
        precision=session.precision,
        activation_bytes=figures.activation_bytes,
        peak_bytes=figures.total_bytes,
        components=components,
        breakdown=dict(sorted(figures.at_activation_peak.items(), key=_label_order)),
        at_step_peak=dict(sorted(figures.at_total_peak.items(), key=_label_order)),
        kept_per_layer=layers,
        head_bytes=figures.head_peak,
        fwd_flops=fwd,
        bwd_flops=total_flops - fwd,
        peak_at=figures.peak_phase,
        micro_batches=accum,
        notes=notes,
    )


def _label_order(item: tuple[str, int]) -> tuple[int, int, str]:
    label = item[0]
    order = [step_.PARAMETERS, step_.OPTIMIZER_STATE, step_.LAST_GRADIENTS, step_.GRADIENTS, step_.EMBEDDING]
    if label in order:
        return (0, order.index(label), label)
    if label.startswith("layer "):
        return (1, int(label.split()[1]), label)
    return (2, 0, label)


def _components(session: Session, figures: step_.StepFigures) -> dict[str, int]:
    """The training state's bytes on this rank (a sharded parameter counts its local shard) and the two figures."""
    from trainer.memory import local_tensors

    def nbytes(tensors: Any) -> int:
        storages = {t.untyped_storage()._cdata: t.untyped_storage() for t in local_tensors(tensors)}
        return sum(s.nbytes() for s in storages.values())

    module = session.module
    params = list(module.parameters())
    state = [v for st in session.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": nbytes(params),
        "buffers": nbytes(module.buffers()),
        "gradients": nbytes(p.grad for p in params) or nbytes(p for p in params if p.requires_grad),
        "optimizer_state": nbytes(state),
        "activation_peak": figures.activation_bytes,
        "head_peak": figures.head_peak,
        "total": figures.total_bytes,
    }


def estimate(config: Config, device: str | None = None, autocast_cache: bool = False) -> Estimate:
    """The configured policy and loss on the estimate's device."""
    session = open_session(config, device, autocast_cache)
    return measure(session, build_policy(config.policy))


def default_policy(name: str) -> Policy:
    """A registered policy with the parameters of its conf/policy/<name>.yaml (the class defaults without one)."""
    path = CONF / "policy" / f"{name}.yaml"
    return build_policy(OmegaConf.load(path) if path.is_file() else {"name": name})


Task = tuple[str, str | None]  # (policy, loss head; None: the configured one)


def estimate_all(
    config: Config,
    device: str | None = None,
    plans: dict[str, Plan] | None = None,
    autocast_cache: bool = False,
    session: Session | None = None,
    known: Estimate | None = None,
    workers: int = 1,
) -> dict[str, Estimate | str]:
    """Every registered policy: the configured one with its parameters, the others with their conf defaults;
    `plans` gives a policy's plan (the one a planner chose for `auto`). A policy that cannot run this model (e.g.
    policy.k > n_layer) maps to its one-line reason; `auto` without a plan is left out. `known`: the configured
    policy's estimate, already made. See `estimate_tables` for `workers`."""
    table, _ = estimate_tables(config, device, plans, autocast_cache, session, known, workers, losses=False)
    return table


def estimate_tables(
    config: Config,
    device: str | None = None,
    plans: dict[str, Plan] | None = None,
    autocast_cache: bool = False,
    session: Session | None = None,
    known: Estimate | None = None,
    workers: int = 1,
    losses: bool = True,
    policies: bool = True,
    first: Callable[[], Estimate] | None = None,
) -> tuple[dict[str, Estimate | str], dict[str, Estimate | str]]:
    """The policy table (`estimate_all`; with `policies` false, only `known`) and, with `losses`, the configured
    policy under every loss head. `first` makes the configured policy's estimate in this process once the workers
    are started (so their start-up overlaps it); it stands for `known`.

    A policy whose plan runs as one already measured (selective under fused attention, offload without a device to
    offload from: both `none`) takes that estimate under its own name. `workers` > 1 measures part of the work in
    other processes, each with a session of its own: the fake run is Python-bound, so on 2 cores the tables of a 7B
    model take about half the time."""
    session = session or open_session(config, device, autocast_cache)
    configured = build_policy(config.policy).cfg.name
    table: dict[str, Estimate | str] = {}
    heads: dict[str, Estimate | str] = {}
    tasks: list[Task] = []
    own_policy = known.policy if known is not None else configured if first is not None else None
    own_loss = known.loss if known is not None else config.loss.name if first is not None else None
    for name in POLICIES:
        if name == own_policy:
            if known is not None:
                table[name] = known
        elif not policies:
            continue
        elif name == "auto" and (plans or {}).get("auto") is None:
            table[name] = "needs a budget (policy=auto policy.budget_mib=…) to plan"
        else:
            tasks.append((name, None))
    for name in LOSSES if losses else ():
        if name == own_loss:
            if known is not None:
                heads[name] = known
        else:
            tasks.append((configured, name))
    shares = _split(tasks, workers, session, config, plans, first is not None) if workers > 1 else [tasks]
    pool = None
    futures = []
    if len(shares) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(len(shares) - 1, mp_context=multiprocessing.get_context("spawn"))
        futures = [pool.submit(_run_tasks, config, session.device, plans, autocast_cache, t) for t in shares[1:]]
    done: dict[Task, Estimate | str] = {}
    try:
        if first is not None:
            known = first()
            table[known.policy] = known
            if losses:
                heads[known.loss] = known
        done |= _run_tasks(config, session.device, plans, autocast_cache, shares[0], session, known)
        for f in futures:
            done |= f.result()
    finally:
        if pool is not None:
            pool.shutdown()
    for (name, loss), value in done.items():
        if loss is None:
            table[name] = value
        else:
            heads[loss] = value
    return ({n: table[n] for n in POLICIES if n in table}, {n: heads[n] for n in LOSSES if n in heads})


def _run_tasks(
    config: Config,
    device: str,
    plans: dict[str, Plan] | None,
    autocast_cache: bool,
    tasks: list[Task],
    session: Session | None = None,
    known: Estimate | None = None,
) -> dict[Task, Estimate | str]:
    """Each (policy, loss head) of `tasks` on `session` (a new one in a worker process), each run measured once."""
    own = session is None
    session = session or open_session(config, device, autocast_cache)
    configured = build_policy(config.policy)
    fake_cpu = not (session.device == "cuda" and torch.cuda.is_available())
    measured: dict[tuple[str, str], Estimate] = {}
    if known is not None:
        measured[(_same_run(known.plan, fake_cpu), known.loss)] = known
    current = config.loss
    out: dict[Task, Estimate | str] = {}
    try:
        for name, loss_name in tasks:
            try:
                policy = configured if name == configured.cfg.name else default_policy(name)
                if name == "auto":
                    policy.choose((plans or {})["auto"].treatments)  # type: ignore[attr-defined]
                loss = None if loss_name is None else replace(current, name=loss_name)
                with _quiet_policy_notices():
                    policy.check(session.module.adapter.n_layer, session.module.adapter.attention)
                    plan = resolve_plan(policy, session.module.adapter).describe()
                    key = (_same_run(plan, fake_cpu), loss_name or current.name)
                    if key in measured:
                        out[(name, loss_name)] = replace(measured[key], policy=name, plan=plan)
                        continue
                    out[(name, loss_name)] = measured[key] = measure(session, policy, loss)
            except (PolicyError, ValueError) as e:  # a policy this model refuses; a loss head this torch lacks
                out[(name, loss_name)] = str(e)
    finally:
        if own:
            session.close()
    return out


def _split(
    tasks: list[Task], workers: int, session: Session, config: Config, plans: dict[str, Plan] | None, first: bool
) -> list[list[Task]]:
    """Tasks into `workers` shares of about equal work: tasks that run the same step (one is measured, the others
    take its figures) stay together, this process also makes the configured estimate (`first`), and a worker spends
    about a step's time starting up."""
    if len(tasks) <= 2:
        return [tasks]
    fake_cpu = not (session.device == "cuda" and torch.cuda.is_available())
    configured = build_policy(config.policy)
    groups: dict[Any, list[Task]] = {}
    for name, loss in tasks:
        policy = configured if name == configured.cfg.name else default_policy(name)
        try:
            if name == "auto":
                policy.choose((plans or {})["auto"].treatments)  # type: ignore[attr-defined]
            with _quiet_policy_notices():
                policy.check(session.module.adapter.n_layer, session.module.adapter.attention)
            key: Any = (_same_run(resolve_plan(policy, session.module.adapter).describe(), fake_cpu), loss)
        except PolicyError:
            key = (name, loss)  # refused: no step, nearly free
        groups.setdefault(key, []).append((name, loss))
    shares: list[list[Task]] = [[] for _ in range(workers)]
    load = [1.0 if first else 0.0] + [1.0] * (workers - 1)
    for group in groups.values():
        i = min(range(workers), key=lambda k: load[k])
        shares[i] += group
        load[i] += 1.0
    return [s for s in shares if s] if shares[0] else [tasks]


def _same_run(plan: str, fake_cpu: bool) -> str:
    """Plans that run the same step: on CPU kernels `offload` moves nothing, so it is `none`."""
    return plan.replace(":offload", ":none") if fake_cpu else plan


@contextlib.contextmanager
def _quiet_policy_notices() -> Iterator[None]:
    """Estimating every policy must not print each one's one-time notice (e.g. offload on CPU)."""
    from trainer import policies

    logger = logging.getLogger(policies.__name__)
    level = logger.level
    said = set(policies._said)
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
        policies._said.intersection_update(said)  # a later real run still gets its notice


def planner_plan(config: Config, device: str) -> tuple[Plan, str, str]:
    """policy=auto: the plan, loss head and explanation trainer/planner.py chooses (a PolicyError when none fits),
    profiled on fake tensors like the rest of the estimate: bytes as a run measures them, step times ranked by
    FLOPs (a run plans on measured times, so near-equal plans may differ)."""
    from trainer.planner import plan_for_config

    return plan_for_config(config, device, fake=True)


# ----------------------------------------------------------------------------------------------------
# The command line.
# ----------------------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'40GB' (10⁹ bytes), '40GiB' (2³⁰), '40000MiB', '1.5TB', '123456' (bytes); case-insensitive."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"--budget {text!r}: write a positive size such as 40GB, 40GiB or 40000MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _mib(n: float) -> str:
    return f"{n / MIB:,.1f}"


def _flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} FLOP"


def _size(n: int) -> str:
    """A budget as the user likely wrote it: GB (10⁹) from 1 GB up, MiB below."""
    return f"{n / 1e9:,.4g} GB" if n >= 10**9 else f"{n / MIB:,.1f} MiB"


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def render(
    session: Session,
    est: Estimate,
    table: dict[str, Estimate | str],
    losses: dict[str, Estimate | str],
    budget: int | None,
) -> str:
    """The report: the configured policy's breakdown, its FLOPs, every policy and every loss head side by side, the
    verdict."""
    config, module = session.config, session.module
    d = module.adapter.describe()
    none = table.get("none")
    base = none.flops if isinstance(none, Estimate) else est.flops
    lines = [
        f"model {config.model.name} ({d['family']}): {d['n_layer']} layers, n_embd {d['n_embd']}, {d['n_head']} heads "
        f"({d['n_kv_head']} key/value), vocab {d['vocab_size']}, {d['params']:,} parameters; "
        f"attention={d['attention']}, tied head={d['tied_head']}",
        f"micro-batch {config.batch_size} × {config.seq_len} tokens, accum={config.accum}, precision={est.precision}, "
        f"loss={est.loss}, device={est.device} (--device cpu|cuda)",
    ]
    lines += [f"assumption: {n}" for n in dict.fromkeys(est.notes)]
    c = est.components
    lines += ["", f"memory, policy={est.policy} (plan {est.plan}), MiB:"]
    rows = [
        ("parameters", c["parameters"], ""),
        ("buffers", c["buffers"], ""),
        ("AdamW state (exp_avg, exp_avg_sq, step)", c["optimizer_state"], ""),
        ("gradients", c["gradients"], "(last step's alive through the forward; zero_grad after it)"),
        ("activation peak of one micro-batch", est.activation_bytes, "(memory/activation_peak_mib), of which:"),
    ]
    rows += [(f"  {label}", v, "") for label, v in _grouped(est.breakdown).items()]
    rows += [
        ("head and loss at its largest", est.head_bytes, f"(loss={est.loss}: final norm, logits, loss)"),
        ("total: the step's peak", est.peak_bytes, "(memory/peak_total_mib), of which:"),
    ]
    rows += [(f"  {label}", v, "") for label, v in _grouped(est.at_step_peak).items()]
    lines += [f"  {label:<44}{_mib(v):>12}  {note}".rstrip() for label, v, note in rows]
    per = est.kept_per_layer
    if per:
        per_text = f"{len(per)} × {_mib(per[0])}" if len(set(per)) == 1 else " ".join(_mib(x) for x in per)
        lines.append(f"  kept from forward to backward per layer: {per_text} MiB")
    lines += [
        "",
        f"compute per optimizer step ({est.micro_batches} micro-batch{'es' if est.micro_batches > 1 else ''}): "
        f"forward {_flops(est.fwd_flops)}, backward {_flops(est.bwd_flops)} (recompute included) "
        f"= {est.flops / base:.3f}× the FLOPs of `none`",
        "",
    ]
    fits_head = f"fits {_size(budget)}?" if budget is not None else "fits? (no --budget)"
    lines += [
        f"| policy | plan | activation peak MiB | head MiB | total MiB | FLOPs × none | {fits_head} |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for name, e in table.items():
        star = " *" if name == est.policy else ""
        if isinstance(e, str):
            lines.append(f"| {name}{star} | n/a: {e} | | | | | |")
            continue
        fits = "—" if budget is None else ("yes" if e.fits(budget) else "no")
        lines.append(
            f"| {name}{star} | {_short(e.plan)} | {_mib(e.activation_bytes)} | {_mib(e.head_bytes)} | "
            f"{_mib(e.peak_bytes)} | {e.flops / base:.3f} | {fits} |"
        )
    lines.append("(* the configured policy; the others with their conf/policy defaults)")
    if losses:
        std = losses.get("standard")
        lines += [
            "",
            f"loss heads under policy={est.policy} (loss.chunk_tokens="
            f"{config.loss.chunk_for(config.batch_size * config.seq_len)}):",
            "",
            "| loss | head MiB | activation peak MiB | total MiB | FLOPs × standard |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, e in losses.items():
            star = " *" if name == est.loss else ""
            if isinstance(e, str):
                lines.append(f"| {name}{star} | n/a: {e} | | | |")
                continue
            ratio = e.flops / std.flops if isinstance(std, Estimate) else 1.0
            lines.append(
                f"| {name}{star} | {_mib(e.head_bytes)} | {_mib(e.activation_bytes)} | {_mib(e.peak_bytes)} | "
                f"{ratio:.3f} |"
            )
    if budget is not None:
        ok = est.fits(budget)
        fitting = [n for n, e in table.items() if isinstance(e, Estimate) and e.fits(budget)]
        lines.append(
            f"policy={est.policy} {'fits' if ok else 'does not fit'} in {_size(budget)} "
            f"({budget / 2**30:,.2f} GiB): it needs {est.peak_bytes / 2**30:,.2f} GiB ({_mib(est.peak_bytes)} MiB)"
            + ("" if ok else f"; policies that fit: {', '.join(fitting) or 'none'}")
        )
    return "\n".join(lines)


def _grouped(by_label: dict[str, int]) -> dict[str, int]:
    """Labels for the report: the layers' forward bytes summed, the rest as they are."""
    out: dict[str, int] = {}
    names = {
        step_.PARAMETERS: "parameters and buffers",
        step_.OPTIMIZER_STATE: "AdamW state",
        step_.LAST_GRADIENTS: "last step's gradients",
        step_.GRADIENTS: "this step's gradients",
        step_.EMBEDDING: "embedding (forward)",
        step_.HEAD: "head and loss (forward and backward)",
        step_.BACKWARD: "backward: gradients in flight, recompute",
        step_.LATER: "later micro-batches",
        step_.OPTIMIZER: "optimizer step temporaries",
    }
    for label, v in by_label.items():
        key = "layers' forward (kept for backward)" if label.startswith("layer ") else names.get(label, label)
        out[key] = out.get(key, 0) + v
    return {k: v for k, v in out.items() if v}


def compose_config(overrides: Sequence[str]) -> Config:
    """train.py's config from the same overrides, validated (raises Hydra, Config or Policy errors)."""
    from hydra import compose, initialize_config_dir

    from trainer.schema import register_configs, validate

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return validate(cfg)


def to_json(
    session: Session,
    est: Estimate,
    table: dict[str, Estimate | str],
    losses: dict[str, Estimate | str],
    budget: int | None,
) -> dict[str, Any]:
    config = session.config

    def one(v: Estimate | str) -> dict[str, Any]:
        return v.to_json() | {"fits": v.fits(budget)} if isinstance(v, Estimate) else {"error": v}

    return {
        "config": {
            "model": config.model.name,
            **session.module.adapter.describe(),
            "batch_size": config.batch_size,
            "seq_len": config.seq_len,
            "accum": config.accum,
            "precision": est.precision,
            "loss": asdict(config.loss),
        },
        "device": est.device,
        "assumptions": list(dict.fromkeys(est.notes)),
        "budget_bytes": budget,
        "policy": est.policy,
        "fits": est.fits(budget),
        "estimate": est.to_json(),
        "all_policies": {k: one(v) for k, v in table.items()},
        "loss_heads": {k: one(v) for k, v in losses.items()},
    }


def _check_writable(path: Path) -> None:
    """--json PATH: a file that can be written (its folder made if missing); a one-line ValueError otherwise."""
    if path.is_dir():
        raise ValueError(f"--json {path} is a folder; give a file path such as {path / 'estimate.json'}")
    folder = next((p for p in (path.parent, *path.parent.parents) if p.exists()), Path("."))
    if not (folder.is_dir() and os.access(folder, os.W_OK)):
        raise ValueError(f"--json {path}: cannot write under {folder}; give a path in a writable folder")


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog="python -m trainer.estimate",
        description="Memory and FLOPs of a training configuration under every activation policy and loss head, from "
        "the real model on fake tensors: no data, no weights, no GPU.",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py (model=llama2-7b policy=full)")
    parser.add_argument("--budget", help="device memory to fit in: 40GB (10⁹ bytes), 40GiB, 40000MiB")
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="also write the estimate here as JSON")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if the run would use one, else cpu")
    parser.add_argument(
        "--autocast-cache",
        action="store_true",
        help="model torch.autocast with its weight cache on (a bare loop's default); train.py runs it off",
    )
    parser.add_argument("--policies", default="all", choices=("all", "configured"),
                        help="'all' (default: every registered policy) or 'configured'")  # fmt: skip
    args = parser.parse_intermixed_args(argv)  # options may come before, between or after the overrides

    from trainer.schema import describe_user_error

    try:
        budget = None if args.budget is None else parse_bytes(args.budget)
        if args.json_path:
            _check_writable(Path(args.json_path))  # before the work, not after it
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    session: Session | None = None
    try:
        config = compose_config(args.overrides)
        policy = build_policy(config.policy)
        device = estimate_device(config, args.device)
        plans: dict[str, Plan] = {}
        preface = ""
        if policy.cfg.name == "auto":
            if config.model.family != "hf":
                with _quiet_policy_notices():
                    policy.check(config.model.n_layer, config.model.attention)  # a missing budget: one line, exit 2
            plan, loss_name, preface = planner_plan(config, device)
            plans = {"auto": plan}
            policy.choose(plan.treatments)  # type: ignore[attr-defined]
            if loss_name and loss_name != config.loss.name:
                config.loss = replace(config.loss, name=loss_name)
        session = open_session(config, device, args.autocast_cache)
        opened = session

        def configured() -> Estimate:
            with _quiet_policy_notices():
                return measure(opened, policy)  # a policy this model refuses fails here, one line

        table, losses = estimate_tables(
            config,
            device,
            plans,
            args.autocast_cache,
            session=session,
            workers=min(2, os.cpu_count() or 1),
            policies=args.policies == "all",
            first=configured,
        )
        est = table[policy.cfg.name]
        assert isinstance(est, Estimate)
    except Exception as e:
        line = describe_user_error(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2
    finally:
        if session is not None:
            session.close()
    if preface:
        print(preface.rstrip() + "\n")
    print(render(session, est, table, losses, budget))
    if args.json_path:
        path = Path(args.json_path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, to_json(session, est, table, losses, budget))
        except OSError as e:
            print(f"error: --json {path}: cannot write it ({e.strerror or e}); the estimate is printed above",
                  file=sys.stderr)  # fmt: skip
            return 2
    return 0


__all__ = ["CudaKernelRules", "Estimate", "Session", "estimate", "estimate_all", "main", "measure", "open_session"]


if __name__ == "__main__":
    sys.exit(main())
