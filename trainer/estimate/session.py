"""The estimator's session: the configured LightningModule built on fake tensors of the estimate's device and stepped
as Lightning steps it, and `measure`, one policy's figures from it (what a run logs: memory/activation_peak_mib and
memory/peak_total_mib, and the step's FLOPs). The tables, the CLI and a configuration's plan stand on this module,
which imports none of them.

Devices. The fake tensors live on the device the run would use: with a CUDA device visible, fake CUDA tensors run
CUDA's kernels, dropout masks and autocast rules. Without one (or with `--device cuda` on a CPU-only torch), the
figures follow the CPU kernels, translated for `--device cuda` by one stated rule per kernel whose bytes differ on
CUDA (see `CudaKernelRules`); what no rule translates is named in the output.

Near tools: `torch.distributed._tools.FSDPMemTracker` and `SACEstimator` estimate FSDP2 memory and SAC trade-offs on
fake tensors per module; this session steps the run's own LightningModule (policy, loss head, precision plugin,
optimizer) as Lightning steps it, so its figures are the run's to the byte on CPU.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from trainer import precision as precision_
from trainer.core import step as step_
from trainer.core.module import explain_group_stand_ins
from trainer.core.resolve import loss_refused_under_tensor_parallel
from trainer.core.schema import Config, ConfigError
from trainer.errors import PolicyError
from trainer.loss import LossConfig
from trainer.measure.fake.cuda_attention import cuda_sdpa
from trainer.measure.fake.process_group import fake_mesh, real_mesh_arithmetic, release
from trainer.measure.memory.caching_allocator import AllocatorConf, replay
from trainer.measure.time.collectives import Collectives
from trainer.measure.time.op_trace import OpTrace, Work
from trainer.measure.time.roofline import Speed, StepTime
from trainer.policies import Policy, apply_policy, build_policy
from trainer.policies.library import draws_dropout
from trainer.policies.offload import HostLedger, offload_to_ledger

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
    * scaled_dot_product_attention: the kernel a CUDA GPU picks (flash, memory-efficient or math), run through its
      own aten op (trainer/measure/fake/cuda_attention.py), so its saved tensors, FLOPs and op name (what SAC save
      lists written for a GPU match) are CUDA's; on CPU SDPA runs `_scaled_dot_product_flash_attention_for_cpu`,
      or with dropout the math path, which keeps fp32 T×T probabilities where CUDA's kernels keep none.
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
        dropout = self._saved["dropout"]

        def rule_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
            if training and p > 0:
                return torch.native_dropout(input, p, True)[0]
            return dropout(input, p, training, inplace)

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
        F.scaled_dot_product_attention = cuda_sdpa
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
    # the most bytes the head (final norm, logits, loss; forward and backward) held at once; None compiled (no regions)
    head_bytes: int | None
    fwd_flops: int
    bwd_flops: int  # the recompute included (a checkpointed forward runs again inside the backward)
    peak_at: str = ""
    micro_batches: int = 1
    notes: list[str] = field(default_factory=list)
    total_peak_at: str = ""  # what the op that set the step's peak belongs to ("layer 3", "backward", "optimizer")
    host_pinned_bytes: int = 0  # offload's copies in pinned host memory at most (per rank; --device cuda)
    work: Work = field(default_factory=Work)  # the step's ops, for the step-time model (trainer.measure.time.roofline)
    tokens: int = 0  # per optimizer step, per rank
    # --device cuda: the caching allocator's reserved peak for this step
    # (trainer/measure/memory/caching_allocator.py), what
    # torch.cuda.max_memory_reserved() reports and trainers print; None for a CPU estimate
    reserved_bytes: int | None = None
    allocator: str = ""  # the allocator mode that replay modelled: "default" | "expandable segments" ("" on cpu)

    def step_time(self, speed: Speed) -> StepTime:
        """The step's predicted time on `speed`'s device (trainer.measure.time.roofline)."""
        return speed.predict(self.work)

    @property
    def flops(self) -> int:
        return self.fwd_flops + self.bwd_flops

    def fits(self, budget_bytes: int | None) -> bool | None:
        return None if budget_bytes is None else self.peak_bytes <= budget_bytes

    def to_json(self) -> dict[str, Any]:
        doc = {k: v for k, v in asdict(self).items() if k != "work"}
        return {**doc, "flops": self.flops, "work": self.work.to_json()}


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
    tensor_parallel: int = 1  # the ranks each layer is split over (trainer.tensor_parallel)
    host: HostLedger = field(default_factory=HostLedger)  # offload's host copies (device cuda), per measure
    group: Any = None  # trainer=fsdp2: the fake process group(s) this session made, destroyed by close()
    # --device cuda: the caching allocator's settings the run will have (PYTORCH_CUDA_ALLOC_CONF, as torch reads it;
    # read by open_session for a CUDA estimate only)
    alloc_conf: AllocatorConf = field(default_factory=AllocatorConf)

    @property
    def offloads(self) -> bool:
        """Offload moves activations off the estimated device: a CUDA device (a CPU run keeps them where they are)."""
        return self.device == "cuda"

    closed: bool = False

    def close(self) -> None:
        """Leave the fake process group of an FSDP2 estimate (a later estimate, or a run, may make its own), and
        under trainer.compile=true dynamo's caches of the fake graphs (a run predicting itself compiles its own
        model next). Its figures stay readable; measuring on it again is not possible."""
        if not self.closed:
            release(self.group)
        if not self.closed and self.config.trainer.compile:
            from torch._dynamo import reset

            reset()
        self.closed = True

    def release_group(self) -> Session | None:
        """The session still usable alongside another world size's: itself on one device, else None (closed, so
        its process group is free for the next FSDP2 estimate: one process holds one)."""
        if self.group is not None:
            self.close()
        return None if self.closed else self

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        offload = offload_to_ledger(self.host) if self.offloads else contextlib.nullcontext()
        with _one_line_when_unrunnable(), self.fake, self.rules, _real_semantics(self.config), offload:
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
    grouped matmul: trainer/measure/fake/kernels.py), and a library's own (models/hf.py: as_on_real_tensors). Not the
    library's under trainer.compile=true: a compiled run's model code runs while dynamo traces it, on fake tensors
    too, so it takes the path fake tensors take (transformers builds its explicit attention mask there)."""
    from trainer.measure.fake.kernels import cpu_kernel_rules

    with contextlib.ExitStack() as stack:
        stack.enter_context(cpu_kernel_rules())
        if config.model.family == "hf" and not config.trainer.compile:
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
        torch_dir, trainer_dir = Path(torch.__file__).parent, Path(__file__).parents[1]
        where = "the model"
        tb = e.__traceback__
        while tb is not None:  # the innermost frame outside torch and the trainer: the model's own code
            path = Path(tb.tb_frame.f_code.co_filename)
            if not (path.is_relative_to(torch_dir) or path.is_relative_to(trainer_dir)):
                where = f"{tb.tb_frame.f_code.co_qualname} ({path.name}:{tb.tb_lineno})"
            tb = tb.tb_next
        raise ConfigError(f"cannot estimate this model on fake tensors: {e.func} in {where}, because {why}") from None


def estimate_device(config: Config, device: str | None) -> str:
    """The device the estimate is for: `--device`, else the one the run trains on (trainer/core/build.py), except that
    trainer.accelerator=gpu on a machine without one is estimated for CUDA (translated), not refused."""
    if device is not None:
        return device
    from trainer.core import build

    return "cuda" if config.trainer.accelerator in ("gpu", "cuda") else build.train_device(config)


class _CachedAutocast:
    """--autocast-cache: a bare loop's default torch.autocast (weight cache on) instead of Lightning's (off)."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin

    def forward_context(self) -> Any:
        p = self.plugin
        return torch.autocast(p.device, dtype=torch.bfloat16 if p.precision == "bf16-mixed" else torch.half)

    def convert_module(self, module: Any) -> Any:
        return self.plugin.convert_module(module)


def _kernels(device: str, notes: list[str]) -> tuple[str, Any]:
    """The device the fake tensors live on, and the rules that translate CPU kernels to CUDA's where needed."""
    fake_device = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    rules: Any = contextlib.nullcontext()
    if device == "cuda" and fake_device == "cpu":
        rules = CudaKernelRules()
        notes.append(
            "figures follow the CPU kernels (no CUDA device visible to this torch), translated to CUDA's kernels by "
            "one rule each: 1-byte dropout masks, attention through the kernel a CUDA GPU picks (flash, "
            "memory-efficient or math), fp32 softmax under autocast; "
            "not translated: " + "; ".join(UNTRANSLATED_CUDA)
        )
    elif fake_device == "cpu":
        notes.append("figures follow the CPU kernels (device cpu); --device cuda translates them to CUDA's")
    return fake_device, rules


def _plugin(chosen: str, fake_device: str, autocast_cache: bool, notes: list[str]) -> Any:
    """Lightning's precision plugin for the run's precision, as the fake step can run it."""
    plugin = precision_.plugin(chosen, fake_device)
    if autocast_cache and chosen.endswith("-mixed"):
        plugin = _CachedAutocast(plugin)
        notes.append(
            "autocast weight cache on (--autocast-cache): a bare loop's default torch.autocast; train.py "
            "runs Lightning's, with it off"
        )
    elif chosen.endswith("-mixed"):
        notes.append("autocast weight cache off, as train.py runs it (Lightning's MixedPrecision)")
    if getattr(plugin, "scaler", None) is not None:
        plugin.scaler = None  # its step reads found_inf with .item(), which a fake tensor has no value for
        notes.append("precision=16-mixed: GradScaler's scale and inf-check scalars (a few bytes) left out")
    return plugin


def open_session(config: Config, device: str | None = None, autocast_cache: bool = False) -> Session:
    """Build the configured module on fake tensors of the estimate's device, and step it once."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainer.core import build

    if config.trainer.compile and estimate_device(config, device) == "cuda" and torch.cuda.is_available():
        raise ConfigError(
            "trainer.compile=true is not estimated where a CUDA device is visible yet (inductor would compile Triton "
            "kernels and launch them on fake tensors): estimate it with the GPU hidden, CUDA_VISIBLE_DEVICES= python "
            "-m trainer.estimate ... --device cuda, which translates the CPU's compiled step to CUDA's kernels"
        )
    cuda = estimate_device(config, device) == "cuda"
    alloc_conf = AllocatorConf.from_env() if cuda else AllocatorConf()  # a setting torch refuses: one line, now
    facts = build.resolve(config, estimate_device(config, device), estimate=True)
    device, chosen, hf_config, vocab, world = facts.device, facts.precision, facts.hf_config, facts.vocab, facts.world
    notes: list[str] = []
    if config.precision == "auto":
        assumed = device == "cuda" and not torch.cuda.is_available()
        notes.append(facts.why if assumed else facts.why + " (as train.py chooses on this machine)")
    fake_device, rules = _kernels(device, notes)
    from trainer.core.data import check_config

    tokenizer_from = config.model.name_or_path if config.data.tokenizer == "model" else None
    check_config(config.data, config.seq_len, config.batch_size, tokenizer_from)  # the run's refusals, no data read
    if config.model.vocab_size is None and config.model.family != "hf":
        notes.append(f"vocab_size {vocab} from data.tokenizer={config.data.tokenizer} (model.vocab_size overrides it)")
    tp = facts.tensor_parallel
    if config.trainer.compile and world * tp > 1:
        split = "trainer=fsdp2" if tp == 1 else "trainer.tensor_parallel"
        raise ConfigError(
            f"trainer.compile=true with {split} is not estimated yet (the compiled estimate runs on one device): "
            f"estimate trainer.compile=true without {split}, or {split} without compile"
        )
    mesh, group = fake_mesh(world * tp, fake_device, tp) if world * tp > 1 else (None, None)
    if tp > 1:
        seq = f", the norms and the residual stream 1/{tp} of the sequence" if config.trainer.sequence_parallel else ""
        notes.append(
            f"trainer.tensor_parallel={tp}: one rank of a tensor-parallel group of {tp} (a fake process group): each "
            f"layer's heads and MLP split {tp} ways{seq}, the head's logits "
            + (
                "split by vocabulary through the loss where the plan splits the head (loss parallelism)"
                if config.trainer.loss_parallel
                else "gathered whole"
            )
        )
    if world > 1:
        notes.append(
            f"trainer=fsdp2: one rank of {world} (a fake process group): parameters, gradients and AdamW state "
            f"sharded {world} ways (FSDP2 per layer, then the root), each layer's all-gather buffers, the same "
            "activations, a micro-batch per rank"
        )
    elif config.trainer.strategy == "ddp":
        notes.append("trainer=ddp: one rank, without DDP's gradient buckets (a further copy of the gradients)")
    if config.trainer.compile:
        notes.append(COMPILE_NOTE)
    if precision_.fsdp2_param_dtype(chosen, config.trainer) is not None:
        notes.append(
            "precision=bf16-mixed under FSDP2: its MixedPrecisionPolicy (bf16 parameters for compute and all-gathers, "
            "fp32 gradient reduce-scatter, fp32 sharded master weights and AdamW state), no autocast; "
            "trainer.mixed_precision=autocast estimates autocast over fp32 shards"
        )
    try:
        fake = FakeTensorMode()
        plugin = _plugin(precision_.lightning_precision(chosen, config.trainer), fake_device, autocast_cache, notes)
        with fake, rules, _real_semantics(config), torch.device(fake_device):
            torch.manual_seed(config.seed)
            module = build.module(config, "none", vocab_size=vocab, hf_config=hf_config, precision=chosen)
            dtype = precision_.param_dtype(chosen)
            if dtype != torch.float32:
                _to_dtype(module, dtype)  # what the plugin's convert_module (module.to(dtype)) does
            if mesh is not None:  # what Lightning's ModelParallelStrategy does with the module: its configure_model
                module._device_mesh = mesh
                with real_mesh_arithmetic():
                    module.configure_model()
            module.train()
            if device == "cuda":  # what torch picks for real CUDA parameters, never for fake ones
                module.optimizer_foreach = True
                notes.append("AdamW's foreach implementation, as torch picks it for CUDA parameters")
            optimizer, scheduler = step_.optimizers_of(module)
            v = module.adapter.head.weight.shape[0]
            shape = (config.batch_size, config.seq_len)
            batches = [(torch.randint(0, v, shape), torch.randint(0, v, shape)) for _ in range(config.accum)]
        session = Session(
            config,
            device,
            chosen,
            module,
            optimizer,
            scheduler,
            plugin,
            batches,
            fake,
            rules,
            notes,
            world,
            tensor_parallel=tp,
            group=group,
            alloc_conf=alloc_conf,
        )
        with session.active():
            # Last step's gradients and AdamW's state, as a real step leaves them: one step on the fake tensors, so a
            # parameter no backward reaches (DeepSeek-V3.2's indexer runs under no_grad) has neither, as in the run.
            session.step()
    except BaseException:
        release(group)  # nothing half-made left behind: a later estimate makes its own
        raise
    notes.append(
        "a steady-state step as train.py runs it: forward with last step's gradients alive, zero_grad, backward, "
        "clip, AdamW.step() (the first step peaks lower)"
    )
    return session


def _collectives(session: Session) -> Collectives:
    """FSDP2's traffic for one rank's step: each layer a unit, the root the rest, all-gathered in the dtype compute
    sees (FSDP2's MixedPrecisionPolicy's bf16, else the shards' own) and reduced in fp32 under that policy."""
    if session.world <= 1:
        return Collectives()
    module = session.module
    units = [sum(p.numel() for p in layer.parameters()) for layer in module.adapter.layers]
    total = sum(p.numel() for p in module.model.parameters())
    own = next(p for p in module.model.parameters()).dtype
    param = module.fsdp_param_dtype or own
    reduce = torch.float32 if module.fsdp_param_dtype is not None else own
    # what configure_model set on each layer (fully_shard's reshard_after_forward): read back, not assumed
    resharded = [
        layer._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None for layer in module.adapter.layers
    ]
    return Collectives.fsdp2(
        units, total - sum(units), session.world, param.itemsize, reduce.itemsize, session.config.accum, resharded
    )


COMPILE_NOTE = (
    "trainer.compile=true: the compiled step as inductor compiles it (its partitioner, fusion and buffer reuse), its "
    "generated code run on fake tensors with each fused kernel costed once by the bytes it reads and writes; a CPU "
    "bf16 matmul's oneDNN workspace measured on this CPU; no per-layer breakdown"
)


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
    compiled = session.config.trainer.compile
    if why := policy.caps.not_estimated(compiled):
        raise PolicyError(f"policy {policy.name}: {why}")
    if why := policy.refusal(compiled, draws_dropout(session.module.model)):  # as the run refuses it
        raise PolicyError(why)
    module = session.module
    configured_loss = module.loss_config
    if loss is not None:
        if why := loss_refused_under_tensor_parallel(loss.name, session.tensor_parallel):
            raise ValueError(why)
        module.loss_config = loss
    session.host = HostLedger()
    try:
        with session.active(), contextlib.ExitStack() as stack:
            apply_policy(module.model, policy)
            if session.world > 1:
                explain_group_stand_ins(module.model)  # sharded as a run shards: torch's view warning, explained
            plan = module.model.activation_plan
            if compiled:
                from trainer.measure.fake import compiled as compiled_

                stack.enter_context(compiled_.fake_compiled_runtime())
                compiled_.compile_model(module.model, policy.compile_backend(compiled_.run_generated_code))
                session.step()  # compiles: the metered step runs compiled code, as a run's steps after its first
                # No regions: the layers' hooks would be traced into the graphs (and break them), unlike the run's.
                # a CPU run's compiled step is counted by the allocator: kernels' own workspaces count there
                tracker = compiled_.CpuGraphTracker if session.device == "cpu" else compiled_.GraphTracker
                meter = step_.StepMeter(device_type=None, tracker=tracker)
                counter: OpTrace = compiled_.GraphOpTrace()
            else:
                meter = step_.StepMeter(device_type=None, regions=True)
                counter = OpTrace()
            forward: dict[str, int] = {}
            with counter:
                try:
                    session.step(meter, on_forward=lambda: forward.setdefault("flops", counter.total))
                except BaseException:
                    meter.abort()  # the tracker's mode lies above the counter's: it leaves first
                    raise
                figures = meter.end(module)  # before the counter's mode, which lies beneath the tracker
    finally:
        module.loss_config = configured_loss
    components = _components(session, figures)
    accum = session.config.accum
    notes = list(session.notes)
    if (loss or configured_loss).name == "fused":
        notes.append(
            "loss=fused is one op to the tracker: its per-chunk workspace inside (≈ chunk_tokens × vocab × "
            "4 B) is not counted (trainer/loss.py)"
        )
    total_flops = counter.total
    work = counter.work
    work.host_copy_bytes = 2 * session.host.copied
    work.prefetch = bool(policy.treatment_policy("offload").cfg.prefetch)
    work.collectives = _collectives(session)
    fwd = forward.get("flops", 0) * accum
    reserved = None
    if session.device == "cuda":
        reserved = replay(figures.events, figures.adopted, session.alloc_conf).peak_reserved
        notes.append(session.alloc_conf.describe() + " (PYTORCH_CUDA_ALLOC_CONF, or --alloc-conf)")
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
        kept_per_layer=[] if compiled else layers,
        head_bytes=None if compiled else figures.head_peak,
        fwd_flops=fwd,
        bwd_flops=total_flops - fwd,
        peak_at=figures.peak_phase,
        micro_batches=accum,
        notes=notes,
        total_peak_at=figures.total_phase,
        host_pinned_bytes=session.host.peak,
        work=work,
        tokens=accum * session.config.batch_size * session.config.seq_len,
        reserved_bytes=reserved,
        allocator=("expandable segments" if session.alloc_conf.expandable_segments else "default") if reserved else "",
    )


def _label_order(item: tuple[str, int]) -> tuple[int, int, str]:
    label = item[0]
    order = [step_.PARAMETERS, step_.OPTIMIZER_STATE, step_.LAST_GRADIENTS, step_.GRADIENTS, step_.EMBEDDING]
    if label in order:
        return (0, order.index(label), label)
    if label.startswith("layer "):
        return (1, int(label.split()[1]), label)
    return (2, 0, label)


def group_labels(by_label: dict[str, int]) -> dict[str, int]:
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


def _components(session: Session, figures: step_.StepFigures) -> dict[str, int]:
    """The training state's bytes on this rank (a sharded parameter counts its local shard) and the two figures."""
    from trainer.measure.memory.tracker import local_tensors

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
