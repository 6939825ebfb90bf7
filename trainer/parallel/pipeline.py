"""Pipeline stages: a native decoder cut into consecutive stages, and torch's pipelining schedules driving them.

A stage is the model pruned to its share, as torchtitan prunes its models: every stage keeps its run of consecutive
layers (`stage_layers`), the first also the embeddings, the last also the final norm and the head (the family's
`pipeline_parts`); what a stage does not hold is set to None, and the model's own forward runs the pruned model (no
embedding: its input is the residual stream; no final norm: its output is). A stage's module (`PipelineStageModule`)
returns the hidden states; the loss head runs on the last stage as the schedule's `loss_fn` (`stage_loss`), so every
loss head (standard, chunked, fused) works there. A policy installs on a stage through the decoder contract as on
a whole model (`stage_policy`): a per-block plan addresses the model's global blocks, each stage taking its slice;
any other policy plans the stage's own blocks.

Near tools: torchtitan's `pipeline_llm` (deletes the layers of a meta-device model and sets its embedding and output
to None, as here) and torch's `pipeline()` tracer (cuts one traced graph at split points); ours prunes this project's
modules, so policies, the decoder contract and checkpoint keys stay the model's.

Example::

    stage = PipelineStageModule(prune_to_stage(model, rank, 2))
    schedule = build_schedule("1f1b", [PipelineStage(stage, rank, 2, device)], 4, stage_loss(stage, loss))
    schedule.step(x) if rank == 0 else schedule.step(target=y, losses=losses)

Known limitations: native families only (a Hugging Face model's forward has no pruned form); tied embeddings (the
embedding on the first stage, the head on the last) are refused. Trained by trainer.core.stages (replicated for data
parallelism), estimated per rank by trainer.estimate.pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models.adapter import adapter_for
from trainer.errors import ConfigError
from trainer.loss import LossConfig, head_loss

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class PipelineLayout:
    """A pipeline as torch's schedules will run it, checked (`layout`): `ranks` ranks holding `virtual` stages each
    (rank r: stages r, r + ranks, …), `n_microbatches` micro-batches a step."""

    ranks: int
    schedule: str
    virtual: int
    n_microbatches: int

    @property
    def n_stages(self) -> int:
        return self.ranks * self.virtual

    def stages_of(self, rank: int) -> list[int]:
        return [rank + self.ranks * v for v in range(self.virtual)]


def layout(ranks: int, schedule: str, virtual: int, n_microbatches: int, n_layer: int) -> PipelineLayout:
    """The layout of trainer.pipeline_parallel=`ranks`, refused in one line where torch's schedule would refuse it
    later (or where the stages cannot split the layers), each naming the setting that fixes it."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"trainer.pipeline_schedule={schedule}: choose one of {', '.join(SCHEDULES)}")
    if virtual > 1 and schedule != "interleaved_1f1b":
        raise ConfigError(
            f"trainer.pipeline_virtual={virtual} puts several stages on a rank, which only "
            "trainer.pipeline_schedule=interleaved_1f1b runs; set trainer.pipeline_virtual=1 or change the schedule"
        )
    found = PipelineLayout(ranks, schedule, virtual, n_microbatches)
    if n_layer % found.n_stages:
        raise ConfigError(
            f"trainer.pipeline_parallel={ranks} × trainer.pipeline_virtual={virtual} stages cannot split "
            f"model.n_layer={n_layer} evenly; choose a number of stages that divides {n_layer}"
        )
    if schedule == "1f1b" and n_microbatches < found.n_stages:  # torch's Schedule1F1B refuses it
        raise ConfigError(
            f"trainer.pipeline_schedule=1f1b over {found.n_stages} stages needs at least {found.n_stages} "
            f"micro-batches a step; accum={n_microbatches} gives {n_microbatches}: set accum={found.n_stages} or more"
        )
    rounds = max(1, n_microbatches // ranks)
    if schedule == "interleaved_1f1b" and n_microbatches % rounds:  # torch's interleaved schedule refuses it
        raise ConfigError(
            f"trainer.pipeline_schedule=interleaved_1f1b runs its micro-batches in rounds of {ranks}; "
            f"accum={n_microbatches} does not split into them: set accum to a multiple of {ranks}"
        )
    return found


def stage_layers(n_layer: int, n_stages: int, stage: int) -> range:
    """The global indices of the layers stage `stage` of `n_stages` holds: equal consecutive runs."""
    if n_stages < 1 or n_layer % n_stages:
        raise ConfigError(
            f"{n_stages} pipeline stages cannot split model.n_layer={n_layer} evenly; "
            f"choose a number of stages that divides {n_layer}"
        )
    per = n_layer // n_stages
    return range(stage * per, (stage + 1) * per)


def prune_to_stage(model: nn.Module, stage: int, n_stages: int) -> nn.Module:
    """Prune `model` in place to stage `stage` of `n_stages` and return it (its layers renumbered from 0; the global
    indices are `stage_layers`)."""
    parts = getattr(type(model), "pipeline_parts", None)
    if parts is None:
        raise ConfigError(f"{type(model).__name__} cannot be cut into pipeline stages yet; use a native family")
    if getattr(getattr(model, "config", None), "tie_embeddings", False) and n_stages > 1:
        raise ConfigError(
            "tied embeddings put one weight on the first and the last pipeline stage; set model.tie_embeddings=false"
        )
    layers = adapter_for(model).layers
    keep = stage_layers(len(layers), n_stages, stage)
    kept = [layers[i] for i in keep]
    del layers[:]
    layers.extend(kept)
    for where, names in parts.items():
        if (where == "first" and stage == 0) or (where == "last" and stage == n_stages - 1):
            continue
        for name in names:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, None)
    return model


def stage_policy(cfg: Any, n_layer: int, layers: range, attention: str) -> Any:
    """The policy a stage holding global `layers` of `n_layer` installs. A per-block plan names the model's blocks
    (policy.blocks, or policy.pattern repeated from block 0), so each stage takes its slice of it; every other policy
    plans the stage's own blocks, as Megatron's recompute settings apply within each pipeline stage."""
    from dataclasses import replace

    from trainer.policies import build_policy

    policy = build_policy(cfg)
    if policy.name != "per_block":
        return cfg
    policy.check(n_layer, attention)  # one treatment per block of the whole model, or one line
    treatments = policy.block_treatments(n_layer)[layers.start : layers.stop]
    return type(policy)(replace(policy.cfg, blocks=treatments, pattern=[]))


class PipelineStageModule(nn.Module):
    """One stage as torch's `PipelineStage` runs it: the pruned model's hidden states of its input (token ids on the
    first stage, the residual stream after)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return adapter_for(self.model).hidden(x)


def stage_loss(stage: PipelineStageModule, loss: LossConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The schedule's `loss_fn` on the last stage: the configured loss head on the stage's hidden states."""
    adapter = adapter_for(stage.model)

    def loss_fn(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return head_loss(hidden, adapter.head, targets, loss, adapter.logit_transform)

    return loss_fn


def build_schedule(
    name: str, stages: Sequence[Any], n_microbatches: int, loss_fn: Callable[..., torch.Tensor] | None
) -> Any:
    """torch's schedule `name` over this rank's stages (one; several, virtual, for interleaved 1F1B)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(list(stages), n_microbatches, loss_fn=loss_fn)
    if len(stages) != 1:
        raise ConfigError(f"schedule {name} runs one stage per rank; interleaved_1f1b runs several")
    cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches, loss_fn=loss_fn)


def pipeline_stage(
    module: PipelineStageModule,
    stage: int,
    n_stages: int,
    micro_batch: tuple[int, int],
    hidden: int,
    dtype: Any,
    group: Any = None,
) -> Any:
    """torch's `PipelineStage` for `module` with its shapes given (static metadata): token ids (micro_batch) into the
    first stage, the residual stream (micro_batch × hidden, `dtype`) between stages, and the gradients of both.
    Given, no stage infers them by running a forward first, and a stage on fake tensors runs as a real one does.
    `group`: the process group its sends and receives take (None: the default group)."""
    from torch.distributed.pipelining import PipelineStage

    device = next(module.parameters()).device
    # The stream between stages requires grad as a training stage's output does: torch reads from these examples
    # whether a stage receives its input with grad (and so sends its gradient back) and receives its output's gradient;
    # examples without it would make a stage's backward stop at its input, and every earlier stage's gradients zero.
    stream = torch.empty(*micro_batch, hidden, dtype=dtype, device=device, requires_grad=True)
    grad = torch.empty(*micro_batch, hidden, dtype=dtype, device=device)
    tokens = torch.empty(*micro_batch, dtype=torch.long, device=device)
    first, last = stage == 0, stage == n_stages - 1
    return PipelineStage(
        module,
        stage,
        n_stages,
        device,
        input_args=tokens if first else stream,
        output_args=stream,
        input_grads=None if first else grad,
        output_grads=None if last else grad,
        group=group,
    )


def step_rank(sched: Any, ids: list[int], n_stages: int, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """One schedule step as a rank takes it: the micro-batches' tokens on the first stage's rank, the targets on the
    last's; the micro-batches' losses on the last stage's rank ([] elsewhere)."""
    losses: list[torch.Tensor] = []
    args = (x,) if 0 in ids else ()
    kwargs: dict[str, Any] = {"target": y, "losses": losses} if n_stages - 1 in ids else {}
    sched.step(*args, **kwargs)
    return losses


def step_loss(losses: list[torch.Tensor], group: Any, last_rank: int, device: Any) -> torch.Tensor:
    """The step's loss on every rank of the pipeline: the mean of the micro-batches' losses, which the last stage's
    rank (`last_rank` in `group`) holds, broadcast."""
    import torch.distributed as dist

    loss = torch.stack([t.detach() for t in losses]).mean() if losses else torch.zeros((), device=device)
    dist.broadcast(loss, group_src=last_rank, group=group)
    return loss


def update(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, grad_clip: float, group: Any) -> None:
    """What follows the schedule's step in PipelineModule.training_step, in Lightning's order (its optimizer.step
    runs the callbacks' hooks, then the module's): the numeric guard's norm, clipping, the update, zero_grad. The
    estimate of a rank and trainer.check take it from here; the run takes it through those hooks."""
    clip_grad_norm(params, 0.0, group)  # the guard's norm (its float() allocates nothing)
    clip_grad_norm(params, grad_clip, group)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def global_names(model: nn.Module) -> dict[int, str]:
    """The state-dict key of each of `model`'s tensors (by identity), taken before `prune_to_stage`: a stage keeps
    the whole model's names for its checkpoint keys, so a checkpoint of every stage is the whole model's."""
    return {id(t): k for k, t in model.state_dict(keep_vars=True).items()}


def clip_grad_norm(params: Sequence[torch.Tensor], max_norm: float, group: Any) -> torch.Tensor:
    """The whole model's gradient norm over the stages of `group` (each rank holds its stages' gradients), and the
    gradients clipped to `max_norm` by it when `max_norm` > 0: torch's `clip_grad_norm_` over one process's
    parameters, with the squared norms summed across the ranks first, as torchtitan clips under pipelining."""
    import torch.distributed as dist

    held = [p for p in params if p.grad is not None]
    device = params[0].device if params else None  # the group's backend takes the parameters' device (NCCL: CUDA)
    grads = [p.grad for p in held]
    local = torch.nn.utils.get_total_norm(grads, norm_type=2.0) if held else torch.zeros((), device=device)
    squared = local.double() ** 2
    dist.all_reduce(squared, group=group)
    norm = squared.sqrt().float()
    if max_norm > 0 and held:
        torch.nn.utils.clip_grads_with_norm_(held, max_norm, norm)
    return norm
