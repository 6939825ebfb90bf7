"""Is this policy exact on my model? A few training steps under the policy and under `none`, compared.

    python -m trainer.check model=llama-tiny policy=selective accum=2
    python -m trainer.check model=llama-tiny policy=auto policy.budget_mib=120
    python -m trainer.check model=hf model.name_or_path=<folder> policy=op_sac --steps 3

The same overrides as train.py compose the same config. Two modules are built from the same seed (the same
weights), one under `none` and one under the configured policy (`auto` plans first, as at fit start), and both run
`--steps` optimizer steps (`trainer.core.step.bare_step`, as Lightning runs a step) on the same real micro-batches from
the configured data, with the RNG reset to the same state before each step, so dropout draws the same masks. After
each step's backward, every parameter's gradient is compared, and each step's loss.

Exit 0 when everything is equal: bitwise, where the arithmetic is the same (recompute replays the same kernels on
the same inputs: CPU), or within `--tolerance` (relative) where it need not be (CUDA kernels that accumulate in a
different order, torch.compile: default 1e-5 there). Exit 1 with one line naming the first differing parameter.
Bad input: one line, exit 2.

A tensor-parallel layout (`trainer.tensor_parallel=t`) is checked on the CPU over t gloo processes, one tensor-
parallel group: the policy against `none`, both split as the run splits them (bitwise, as above), and `none` split
against `none` in one process, unsplit, dropout off (a split region draws its masks on each rank's share), within
LAYOUT_TOLERANCE: a row-split projection sums its partial products across the ranks, another order than one
process's.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from trainer import precision as precision_
from trainer.core import step as step_
from trainer.core.schema import ConfigError, OneLineParser
from trainer.formatting import markdown_table
from trainer.interpreter import lean_exit


@dataclass
class Difference:
    """The largest difference seen in one parameter group over the steps."""

    group: str
    params: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    first: str = ""  # the first parameter (in model order) that differed beyond the tolerance
    first_step: int = -1


@dataclass
class CheckResult:
    policy: str
    plan: str
    steps: int
    tolerance: float
    exact: bool  # tolerance 0: bitwise
    losses: list[tuple[float, float]] = field(default_factory=list)  # (none, policy) per step
    groups: dict[str, Difference] = field(default_factory=dict)
    first_failure: str | None = None
    own_loss: tuple[float, float] | None = None  # HF: (the project's loss, the model's own forward's), dropout off
    setting: str = ""  # how both sides ran (precision; FSDP2 sharding)
    layout: CheckResult | None = None  # tensor parallelism: `none` split against `none` in one process

    @property
    def equal(self) -> bool:
        return self.first_failure is None


def group_of(name: str) -> str:
    """A parameter's group: its name up to the layer index ("model.layers.3"), else its first component."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0]


def _relative(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    diff = (a.double() - b.double()).abs()
    scale = b.double().abs().max().item() or 1.0
    m = diff.max().item() if diff.numel() else 0.0
    return m, m / scale


OWN_LOSS_TOLERANCE = 1e-5  # relative: the same cross-entropy summed in another order (fp32)
# relative, per parameter: a split layer's gradients against one process's (fp32). Measured 6e-7 to 1.7e-6 on the tiny
# models (`python -m trainer.check model=micro trainer=fsdp2 trainer.devices=2 trainer.tensor_parallel=2`); the margin
# is for deeper models, whose sums are longer.
LAYOUT_TOLERANCE = 1e-4


def own_loss(module: Any, batch: tuple[torch.Tensor, torch.Tensor], plugin: Any) -> tuple[float, float] | None:
    """(the project's training loss, the loss the model's own forward computes with labels) on one micro-batch,
    dropout off, for a Hugging Face model; None for the native families, whose forward is the project's. HF shifts
    `labels` itself and has no target for the last position, so the project's last target is ignored here."""
    if module.adapter.family != "hf":
        return None
    x, y = batch
    shifted_inside = module.adapter.logit_transform.shifts_labels
    y = torch.cat([y[:, :-1], torch.full_like(y[:, -1:], -100)], dim=1) if shifted_inside else y
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), plugin.forward_context():
            ours = float(module.loss_of((x, y)))
            theirs = float(module.model(input_ids=x, labels=x if shifted_inside else y, use_cache=False).loss)
    finally:
        module.train(was_training)
    return ours, theirs


def _plan_first(config: Any, policy: Any, ref: Any, mod: Any, batch: Any, precision: str) -> None:
    """A policy planned before it runs: plan it on the first batch as the run does at fit start, install the plan,
    and train both sides with the plan's loss head."""
    from trainer.estimate.config_plan import plan_module
    from trainer.policies import apply_policy

    result = plan_module(config, mod, policy, batch, precision)
    policy.choose(result.treatments)
    apply_policy(mod.model, policy)
    if result.loss and result.loss != mod.loss_config.name:  # the plan's head, on both sides
        mod.loss_config = ref.loss_config = replace(mod.loss_config, name=result.loss)


def compare_step(
    out: CheckResult,
    s: int,
    names: list[str],
    grads: dict[int, list[torch.Tensor]],
    losses: tuple[float, float],
    tolerance: float,
) -> None:
    """Step `s`'s gradients and losses, the policy's against none's, into `out` (the first failure kept)."""
    out.losses.append(losses)
    for name, g_ref, g in zip(names, grads[0], grads[1], strict=True):
        d = out.groups.setdefault(group_of(name), Difference(group_of(name)))
        if s == 0:
            d.params += 1
        m_abs, m_rel = _relative(g, g_ref)
        d.max_abs, d.max_rel = max(d.max_abs, m_abs), max(d.max_rel, m_rel)
        bad = not torch.equal(g, g_ref) if tolerance == 0.0 else m_rel > tolerance
        if bad and out.first_failure is None:
            out.first_failure = f"{name} at step {s}: max |Δgrad| {m_abs:.3g} ({m_rel:.3g} relative)"
            d.first, d.first_step = name, s
    l_ref, l_pol = losses
    loss_bad = l_ref != l_pol if tolerance == 0.0 else abs(l_pol - l_ref) > tolerance * max(abs(l_ref), 1e-12)
    if loss_bad and out.first_failure is None:
        out.first_failure = f"the loss at step {s}: {l_pol!r} under {out.policy}, {l_ref!r} under none"


def run_check(config: Any, steps: int = 2, tolerance: float | None = None) -> CheckResult:
    """Compare `steps` steps of config.policy with `none` from the same weights and batches (see the module doc)."""
    from trainer.core import build
    from trainer.core.module import DecoderModule
    from trainer.policies import build_policy

    facts = build.resolve(config)  # device, precision (its refusals), HF config: settled as a run settles them
    device, chosen = torch.device(facts.device), facts.precision
    compiled = bool(config.trainer.compile)
    if tolerance is None:
        tolerance = 1e-5 if (device.type == "cuda" or compiled) else 0.0
    policy = build_policy(config.policy)
    if config.model.family != "hf" or policy.caps.planned_first:  # refused before any data is read
        policy.check(config.model.n_layer or 0, config.model.attention)  # (a planner's budget needs no depth)
    stages = config.trainer.pipeline_parallel > 1
    if (facts.tensor_parallel > 1 or stages) and facts.device != "cpu":
        split = "cuts the model into stages" if stages else "splits a layer"
        raise ConfigError(f"trainer.check {split} over gloo processes on the CPU; add trainer.accelerator=cpu")
    if facts.tensor_parallel > 1 and policy.caps.planned_first:
        raise ConfigError(
            "trainer.check with trainer.tensor_parallel plans nothing first: check the plan's treatments by name "
            "(policy=per_block policy.blocks=[...]), or policy=auto with trainer.tensor_parallel=1"
        )
    hf_config = facts.hf_config
    data = build.data_module(config)
    loader = data.train_dataloader()
    per_step = 1 if stages else config.accum  # stages take a step's micro-batches as one batch
    if steps * per_step > len(loader):
        raise ConfigError(
            f"--steps {steps} × accum={config.accum} needs {steps * config.accum} micro-batches and the corpus has "
            f"{len(loader) * config.accum // per_step}; lower --steps (or accum), or give a larger corpus"
        )
    batches = [tuple(t.to(device) for t in b) for b, _ in zip(loader, range(steps * per_step), strict=False)]
    if stages:
        return _stage_check(config, policy, build.vocab(config, data), batches, steps, tolerance)
    if facts.tensor_parallel > 1:
        return _split_check(config, policy, facts, build.vocab(config, data), batches, steps, tolerance)
    step_precision = precision_.lightning_precision(chosen, config.trainer)
    plugin = precision_.plugin(step_precision, device.type)
    with _one_rank_mesh(device.type) if config.trainer.strategy == "fsdp2" else contextlib.nullcontext() as mesh:

        def build_one(p: Any) -> DecoderModule:
            torch.manual_seed(config.seed)
            m = build.module(config, p, vocab_size=build.vocab(config, data), hf_config=hf_config, precision=chosen)
            m = plugin.convert_module(m).to(device)
            m.train()
            if mesh is not None:  # sharded as the run shards it: FSDP2 per layer, its mixed-precision policy
                m._device_mesh = mesh
                m.configure_model()
            return m

        ref, mod = build_one("none"), build_one(policy)
        if policy.caps.planned_first:  # planned on the first batch, as at fit start
            _plan_first(config, policy, ref, mod, batches[0], step_precision)
        if compiled and mesh is None:
            ref.configure_model()
            mod.configure_model()
        out = _compare(config, policy, ref, mod, batches, plugin, steps, tolerance)
    out.setting = f"precision {precision_.describe(chosen, config.trainer)}" + (
        ", both sharded by FSDP2 over a one-rank process group" if config.trainer.strategy == "fsdp2" else ""
    )
    return out


@contextlib.contextmanager
def _one_rank_mesh(device_type: str) -> Iterator[Any]:
    """trainer=fsdp2: a device mesh over a one-rank process group of this process, so both modules are sharded
    (FSDP2's hooks, all-gathers and mixed-precision casts run as on every rank of the run); closed after."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise ConfigError("trainer=fsdp2 check: a process group is already initialised in this process")
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh(device_type, (1,), mesh_dim_names=("data_parallel",))
    finally:
        dist.destroy_process_group()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (a one-rank FSDP2 shard, a tensor-parallel split) gathered whole, on every rank alike."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _split_check(
    config: Any, policy: Any, facts: Any, vocab: int, batches: list[Any], steps: int, tolerance: float
) -> CheckResult:
    """The check on one tensor-parallel group: `t` gloo processes on this CPU, each building the modules as a rank
    of the run builds them; rank 0's result."""
    import pickle
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    t = facts.tensor_parallel
    with tempfile.TemporaryDirectory() as tmp:
        args = (t, tmp, config, policy.cfg, facts.precision, facts.hf_config, vocab, batches, steps, tolerance)
        mp.spawn(_split_rank, args=args, nprocs=t)
        refused = Path(tmp) / "refused"
        if refused.exists():  # what every rank refused before any collective (a degree the model cannot split by)
            raise ConfigError(refused.read_text())
        return pickle.loads((Path(tmp) / "result.pkl").read_bytes())


def _split_rank(
    rank: int,
    t: int,
    tmp: str,
    config: Any,
    policy_cfg: Any,
    chosen: str,
    hf_config: Any,
    vocab: int,
    batches: list[Any],
    steps: int,
    tolerance: float,
) -> None:
    lean_exit()
    import pickle
    from pathlib import Path

    import torch.distributed as dist
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.core import build
    from trainer.errors import UserError
    from trainer.policies import build_policy

    _set_num_threads_if_needed(num_processes=t)  # as the run's ranks (trainer/core/run.py: even_threads)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=t)
    try:
        mesh = init_device_mesh("cpu", (1, t), mesh_dim_names=("data_parallel", "tensor_parallel"))
        plugin = precision_.plugin(precision_.lightning_precision(chosen, config.trainer), "cpu")
        policy = build_policy(policy_cfg)

        def build_one(p: Any, split: bool) -> Any:
            torch.manual_seed(config.seed)
            m = build.module(config, p, vocab_size=vocab, hf_config=hf_config, precision=chosen)
            m = plugin.convert_module(m)
            m.train()
            if split:  # as a rank of the run: TP on the mesh's second dimension, FSDP2 (here of one) on its first
                m._device_mesh = mesh
                m.configure_model()
            return m

        # each comparison from fresh modules: a step moves the weights
        try:
            ref, mod = build_one("none", True), build_one(policy, True)
        except UserError as e:  # refused alike on every rank, before any collective: one line in the parent
            if rank == 0:
                (Path(tmp) / "refused").write_text(str(e))
            return
        out = _compare(config, policy, ref, mod, batches, plugin, steps, tolerance)
        # dropout off for this one: a split region draws its masks on each rank's share, one process on the whole
        one, split = build_one("none", False), build_one("none", True)
        for dropout in (d for m in (one, split) for d in m.modules() if isinstance(d, torch.nn.Dropout)):
            dropout.p = 0.0
        out.layout = _compare(config, build_policy("none"), one, split, batches, plugin, steps, LAYOUT_TOLERANCE)
        out.setting = (
            f"precision {precision_.describe(chosen, config.trainer)}, both split over trainer.tensor_parallel={t} "
            "(gloo processes on this CPU) as the run splits them"
        )
        if out.first_failure is None and out.layout.first_failure is not None:
            out.first_failure = f"split against one process: {out.layout.first_failure}"
        if rank == 0:
            (Path(tmp) / "result.pkl").write_bytes(pickle.dumps(out))
    finally:
        dist.destroy_process_group()


def _stage_check(config: Any, policy: Any, vocab: int, batches: list[Any], steps: int, tolerance: float) -> CheckResult:
    """The check on pipeline stages: trainer.pipeline_parallel gloo processes on this CPU, each building both modules'
    stages as a rank of the run builds them; rank 0's result, over the whole model's gradients gathered there."""
    import pickle
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    ranks = config.trainer.pipeline_parallel
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_stage_rank, args=(ranks, tmp, config, policy.cfg, vocab, batches, steps, tolerance), nprocs=ranks)
        return pickle.loads((Path(tmp) / "result.pkl").read_bytes())


def _stage_rank(
    rank: int,
    ranks: int,
    tmp: str,
    config: Any,
    policy_cfg: Any,
    vocab: int,
    batches: list[Any],
    steps: int,
    tolerance: float,
) -> None:
    """One pipeline rank: `steps` steps of none's stages and the policy's, each on the step's whole batch from the
    same RNG, then the optimizer step as the run takes it; every rank's gradients (the whole model's names) go to
    rank 0, which compares them, and compares none's with one process's (dropout off: each rank draws its own
    stages' masks, one process draws them all in turn)."""
    lean_exit()
    import pickle
    from pathlib import Path

    import torch.distributed as dist
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.core import build
    from trainer.core.schema import Config
    from trainer.parallel.pipeline import update
    from trainer.policies import build_policy

    _set_num_threads_if_needed(num_processes=ranks)  # as the run's ranks (trainer/core/run.py: even_threads)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=ranks)
    try:
        # one pipeline: replicas of it (trainer.devices a multiple of the stages) average what each computes alike
        mesh = init_device_mesh("cpu", (ranks, 1), mesh_dim_names=("pipeline_parallel", "data_parallel"))
        policy = build_policy(policy_cfg)

        def build_one(p: Any, cfg: Config = config, dropout: bool = True) -> Any:
            torch.manual_seed(config.seed)
            m = build.module(cfg, p, vocab_size=vocab, precision="32-true")
            m.train()
            for d in (d for d in m.modules() if isinstance(d, torch.nn.Dropout) and not dropout):
                d.p = 0.0
            if cfg.trainer.pipeline_parallel > 1:
                m._device_mesh = mesh
                m.configure_model()
            return m

        def run(modules: list[Any]) -> tuple[list[dict[str, torch.Tensor]], list[list[float]]]:
            """Each module's gradients (before clipping) and loss at every step, in step order."""
            parts = {m: step_.optimizers_of(m) for m in modules}
            grads: list[dict[str, torch.Tensor]] = []
            losses: list[list[float]] = []
            rng = torch.Generator().manual_seed(config.seed)
            for s in range(steps):
                seed = int(torch.randint(0, 2**31 - 1, (), generator=rng))
                losses.append([])
                for m in modules:
                    opt, sched = parts[m]
                    torch.manual_seed(seed)
                    losses[-1].append(float(m._run(batches[s])))
                    grads.append(m.whole_grads())
                    update(list(m.parameters()), opt, config.trainer.grad_clip, m.group)
                    sched.step()
            return grads, losses

        ref, mod = build_one("none"), build_one(policy)
        grads, losses = run([ref, mod])
        plain, plain_losses = run([build_one("none", dropout=False)])
        gathered: list[Any] = [None] * ranks if rank == 0 else []
        dist.gather_object((grads, plain), gathered if rank == 0 else None, dst=0)
        if rank != 0:
            return
        whole = [{k: v for part in gathered for k, v in part[0][i].items()} for i in range(2 * steps)]
        names = list(whole[0])
        short = [n.removeprefix("model.") for n in names]  # the model's own names, as one process has them
        out = CheckResult(policy.cfg.name, mod.plan_described(), steps, tolerance, tolerance == 0.0)
        for s in range(steps):
            pair = {k: [whole[2 * s + k][n] for n in names] for k in (0, 1)}
            compare_step(out, s, short, pair, (losses[s][0], losses[s][1]), tolerance)
        # one process, none, dropout off, over the same micro-batches: what the stages' `none` must equal
        staged = [{k: v for part in gathered for k, v in part[1][s].items()} for s in range(steps)]
        single = replace(config, trainer=replace(config.trainer, pipeline_parallel=1, pipeline_virtual=1, devices=1))
        one = build_one("none", single, dropout=False)
        opt, sched = step_.optimizers_of(one)
        plugin = precision_.plugin("32-true", "cpu")
        layout = CheckResult("none", one.plan_described(), steps, LAYOUT_TOLERANCE, False)
        for s in range(steps):
            held: dict[int, list[torch.Tensor]] = {}

            def keep(held: dict[int, list[torch.Tensor]] = held) -> None:
                held[0] = [one.model.get_parameter(n).grad.detach().clone() for n in short]

            micro = list(zip(*(t.chunk(config.accum) for t in batches[s]), strict=True))
            loss = step_.bare_step(one, micro, opt, sched, plugin, config.trainer.grad_clip, before_update=keep)
            held[1] = [staged[s][n] for n in names]
            compare_step(layout, s, short, held, (float(loss), plain_losses[s][0]), LAYOUT_TOLERANCE)
        layout.setting = (
            "none in stages against none in one process, dropout off (the schedule sums the micro-batches' gradients, "
            "then scales them; one process scales each)"
        )
        out.layout = layout
        out.setting = (
            f"precision fp32, both cut into {config.trainer.pipeline_parallel} stages under "
            f"{config.trainer.pipeline_schedule} (gloo processes on this CPU) as the run cuts them"
        )
        if out.first_failure is None and layout.first_failure is not None:
            out.first_failure = f"stages against one process: {layout.first_failure}"
        (Path(tmp) / "result.pkl").write_bytes(pickle.dumps(out))
    finally:
        dist.destroy_process_group()


def _compare(
    config: Any,
    policy: Any,
    ref: Any,
    mod: Any,
    batches: list[Any],
    plugin: Any,
    steps: int,
    tolerance: float,
) -> CheckResult:
    """Step both modules `steps` times on the same batches and RNG; compare every gradient and loss."""
    device = batches[0][0].device
    for a, b in zip(ref.state_dict().values(), mod.state_dict().values(), strict=True):
        assert torch.equal(_local(a), _local(b)), "the two modules must start from the same weights"
    out = CheckResult(policy.cfg.name, mod.model.activation_plan.describe(), steps, tolerance, tolerance == 0.0)
    out.own_loss = own_loss(ref, batches[0], plugin)
    if out.own_loss is not None and abs(out.own_loss[0] - out.own_loss[1]) > OWN_LOSS_TOLERANCE * abs(out.own_loss[1]):
        out.first_failure = (
            f"the project's loss {out.own_loss[0]!r} is not the model's own forward's "
            f"{out.own_loss[1]!r} (labels=, dropout off)"
        )
    names = [n for n, p in mod.model.named_parameters() if p.requires_grad]
    parts = {m: step_.optimizers_of(m) for m in (ref, mod)}
    rng = torch.Generator().manual_seed(config.seed)
    for s in range(steps):
        micro = batches[s * config.accum : (s + 1) * config.accum]
        seed = int(torch.randint(0, 2**31 - 1, (), generator=rng))
        grads: dict[int, list[torch.Tensor]] = {}
        losses = []
        for k, m in enumerate((ref, mod)):
            opt, sched = parts[m]
            torch.manual_seed(seed)
            if device.type == "cuda":
                torch.cuda.manual_seed_all(seed)

            def keep(m: Any = m, k: int = k, out: dict[int, list[torch.Tensor]] = grads) -> None:
                out[k] = [  # a parameter no token reached (an expert none routed to) has no gradient: zeros
                    torch.zeros_like(_local(p)) if p.grad is None else _local(p.grad).detach().clone()
                    for p in m.model.parameters()
                    if p.requires_grad
                ]

            loss = step_.bare_step(m, micro, opt, sched, plugin, config.trainer.grad_clip, before_update=keep)
            losses.append(float(loss))
        compare_step(out, s, names, grads, (losses[0], losses[1]), tolerance)
    return out


def render(result: CheckResult) -> str:
    how = "bitwise" if result.exact else f"within {result.tolerance:g} relative"
    lines = [
        f"policy={result.policy} (plan {result.plan}) vs none: {result.steps} optimizer step(s) from the same weights "
        f"and batches, the same dropout masks; compared {how}" + (f"; {result.setting}" if result.setting else ""),
        "",
        markdown_table(
            ("step", "loss (none)", "loss (policy)", "Δ"),
            [(i, f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.3g}") for i, (a, b) in enumerate(result.losses)],
            "rrrr",
        ),
        "",
        markdown_table(
            ("parameter group", "tensors", "max abs Δgrad", "max relative Δgrad"),
            [(d.group, d.params, f"{d.max_abs:.3g}", f"{d.max_rel:.3g}") for d in result.groups.values()],
            "lrrr",
        ),
    ]
    lines.append("")
    if result.own_loss is not None:
        ours, theirs = result.own_loss
        lines.append(
            f"the training loss vs the model's own forward (labels=, dropout off): {ours:.6f} vs {theirs:.6f}"
            f" ({abs(ours - theirs) / max(abs(theirs), 1e-12):.2g} relative)"
        )
    if result.layout is not None:
        worst = max((d.max_rel for d in result.layout.groups.values()), default=0.0)
        loss = max((abs(a - b) for a, b in result.layout.losses), default=0.0)
        what = result.layout.setting or (
            "none split against none in one process, unsplit, dropout off (a row-split projection sums across the "
            "ranks)"
        )
        lines.append(
            f"{what}: max relative Δgrad {worst:.3g}, max |Δloss| {loss:.3g} (within {result.layout.tolerance:g} "
            "relative)"
        )
    if result.equal:
        lines.append(f"equal: every loss and gradient under {result.policy} matches none ({how})")
    else:
        lines.append(f"differs: {result.first_failure}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m trainer.check", description=__doc__)
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides, the same as for train.py (model=llama-tiny policy=selective)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=2,
        help="optimizer steps to compare, each on its own real micro-batches (default 2)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="largest relative difference accepted per loss and gradient; default 0 (bitwise) on CPU, 1e-5 on CUDA "
        "or with trainer.compile=true",
    )
    args = parser.parse_intermixed_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps} must be ≥ 1")
    if args.tolerance is not None and (args.tolerance < 0 or math.isnan(args.tolerance)):
        parser.error(f"--tolerance {args.tolerance} must be ≥ 0")

    from trainer.core.schema import compose_config, user_error_status

    try:
        config = compose_config(args.overrides)
        result = run_check(config, args.steps, args.tolerance)
    except Exception as e:
        return user_error_status(e)
    print(render(result))
    if not result.equal:
        print(f"error: policy={result.policy} differs from none: {result.first_failure}", file=sys.stderr)
        return 1
    return 0
