"""One pipeline rank's step on fake tensors: torch's own schedule over the rank's stages, with torch's fake process
group, counted by the live-tensor tracker as a run counts it.

What a real gloo or NCCL run does that the fake backend does not, put back so the two count the same: a P2P work keeps
its tensor while something references the work (1F1B keeps its first forward's send work through the steady state,
so that micro-batch's stage output outlives its backward); and the schedule's first step, which votes over P2P whether
every stage has static shapes (it calls `.item()`, which fake tensors refuse), is told the answer: the stages have
them (`pipeline_stage`).

Near tools: torch's `_PipelineSchedule` runs the same actions on real ranks; torchtitan estimates nothing. Ours is
that schedule, one rank at a time on fake tensors, so each stage's figure is its own schedule's, micro-batches in
flight included.

Example::

    rank0 = estimate_rank(lambda: Llama(cfg), rank=0, world=2, schedule="1f1b", n_microbatches=4,
                          micro_batch=(2, 16), policy="full", loss=LossConfig())
    rank0.peak, rank0.activations

Known limitations: without `optim`, a bare step (no optimizer, no clipping); with it, AdamW as torch picks it for
CPU tensors (a CUDA run's foreach temporaries are not in it: the estimate is the CPU's); torch ≥ 2.13's pipelining
internals (`_warmup_p2p`,
`InferenceMode`). Outside a run the process becomes rank `rank` of a fake default group; inside one (a run's own
prediction) its sends go to a fake group over the run's ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from models.adapter import adapter_for
from trainer.core.module import adamw
from trainer.core.schema import OptimConfig
from trainer.core.step import training_state
from trainer.loss import LossConfig
from trainer.measure.fake.process_group import fake_rank
from trainer.measure.memory.tracker import LiveTensorTracker
from trainer.measure.time.op_trace import OpTrace, Work
from trainer.parallel.pipeline import (
    PipelineLayout,
    PipelineStageModule,
    build_schedule,
    pipeline_stage,
    prune_to_stage,
    stage_layers,
    stage_loss,
    stage_policy,
    step_loss,
    step_rank,
    update,
)


class RankPeak(NamedTuple):
    """One pipeline rank's steady-state step, in bytes."""

    peak: int  # everything the schedule's step allocated, at its peak: activations, P2P buffers, the gradients
    activations: int  # the same step's peak without the gradients: what the micro-batches in flight hold
    parameters: int = 0  # the rank's stages' parameters, held before and after the step
    work: Work | None = None  # the schedule step's ops (trainer.measure.time.op_trace), for the step-time model
    total: int | None = None  # with an optimizer: the whole step's peak, parameters, AdamW state and update in it


class RankEstimate(NamedTuple):
    """One rank of a configured pipeline (`estimate_pipeline`): its stages, their layers and its peaks."""

    rank: int
    stages: list[int]
    layers: list[range]  # the global layer indices each of its stages holds
    figures: RankPeak


class _HeldWork:
    """A P2P work that keeps its tensor while it is referenced, as a real c10d work does."""

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self.work, self.tensor = work, tensor

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self.work.wait(*args, **kwargs) if self.work is not None else True


@contextlib.contextmanager
def _works_hold_their_tensors() -> Iterator[None]:
    import torch.distributed.distributed_c10d as c10d

    # Both names: P2POp checks its op against the module's own, the schedules call them through torch.distributed.
    saved = {name: getattr(c10d, name) for name in ("isend", "irecv")}

    def held(op: Callable[..., Any]) -> Callable[..., Any]:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> _HeldWork:
            return _HeldWork(op(tensor, *args, **kwargs), tensor)

        return call

    try:
        for name, op in saved.items():
            setattr(c10d, name, held(op))
            setattr(dist, name, getattr(c10d, name))
        yield
    finally:
        for name, op in saved.items():
            setattr(c10d, name, op)
            setattr(dist, name, op)


def estimate_rank(
    build: Callable[[], nn.Module],
    rank: int,
    world: int,
    schedule: str,
    n_microbatches: int,
    micro_batch: tuple[int, int],
    policy: Any = "none",
    loss: LossConfig | None = None,
    virtual: int = 1,
    optim: OptimConfig | None = None,
    grad_clip: float = 0.0,
) -> RankPeak:
    """The peaks of a steady-state step of pipeline rank `rank` of `world` (its stages rank, rank + world, …
    for `virtual` stages a rank): the step's own allocations (activations, gradients, P2P buffers) as the live-tensor
    tracker counts them, `build()` making the whole model (on fake tensors here). With `optim`, the step as
    train.py takes it (trainer.core.stages): the parameters and AdamW's state held from its start, and after the
    schedule the loss's broadcast, the guard's gradient norm, clipping to `grad_clip`, AdamW's update and zero_grad,
    whose peak is `total`."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.pipelining._utils import InferenceMode

    from trainer.policies import apply_policy

    loss = loss or LossConfig()
    n_stages = world * virtual
    ids = [rank + world * v for v in range(virtual)]
    with fake_rank(rank, world) as group, FakeTensorMode(), _works_hold_their_tensors():
        modules = []
        for s in ids:
            model = build()
            n_layer, attention = len(adapter_for(model).layers), getattr(model.config, "attention", "sdpa")
            layers = stage_layers(n_layer, n_stages, s)
            apply_policy(prune_to_stage(model, s, n_stages), stage_policy(policy, n_layer, layers, attention))
            modules.append(PipelineStageModule(model))
        dtype, hidden = next(modules[0].parameters()).dtype, modules[0].model.config.n_embd
        stages = [
            pipeline_stage(m, s, n_stages, micro_batch, hidden, dtype, group) for m, s in zip(modules, ids, strict=True)
        ]
        last = modules[ids.index(n_stages - 1)] if n_stages - 1 in ids else modules[0]
        sched = build_schedule(schedule, stages, n_microbatches, stage_loss(last, loss))

        def static(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
            for stage in stages:
                stage._inference_mode = InferenceMode.STATIC

        sched._warmup_p2p = static
        vocab = modules[0].model.config.vocab_size
        x, y = (torch.randint(0, vocab, (n_microbatches * micro_batch[0], micro_batch[1])) for _ in range(2))
        stage_models = nn.ModuleList([m.model for m in modules])
        params = list(stage_models.parameters())
        optimizer = None if optim is None else adamw(stage_models, optim)
        for _ in range(2):  # the second step is the steady state: the first builds the P2P buffers, AdamW's state
            stage_models.zero_grad(set_to_none=True)
            with LiveTensorTracker() as tracker:
                if optimizer is not None:  # what the run's step holds from its start (StepMeter.begin)
                    for label, tensors in training_state(stage_models, [optimizer]).items():
                        tracker.adopt(tensors, label)
                with OpTrace() as trace:
                    losses = step_rank(sched, ids, n_stages, x, y)
                window = tracker.mark()  # where the run's measuring callback closes its activation window
                grads = [p.grad for p in params]
                if optimizer is not None:  # PipelineModule.training_step, its hooks in Lightning's order
                    held = step_loss(losses, group, world - 1, "cpu")  # self.last_loss
                    del losses
                    update(params, optimizer, grad_clip, group)
                    del held
        weights = sum(p.numel() * p.element_size() for p in params)
        activations = tracker.peak_bytes_excluding(grads, until=window)
        peak = tracker.peak_bytes_excluding([], until=window)
        total = tracker.peak_bytes if optimizer is not None else None
        return RankPeak(peak, activations, weights, trace.work, total)


def rank_total(figures: RankPeak) -> int:
    """What a rank holds at its step's peak: the whole step's, estimated with its optimizer (`estimate_rank`'s
    `optim`): the parameters, AdamW's state, the schedule's step and the update."""
    if figures.total is None:
        raise ValueError("a rank estimated without its optimizer has no total: pass optim to estimate_rank")
    return figures.total


class RankFit(NamedTuple):
    """The fewest of a rank's layers (in order, its stages' one after another) recomputed whole so it fits a budget."""

    rank: int
    recomputed: int  # of the rank's layers, the first this many `full`, the rest `none`
    layers: int  # the rank's layers
    total: int  # rank_total at that plan
    fits: bool  # False: even every layer recomputed does not fit (`recomputed` = `layers`)


def fit_ranks(config: Any, pipeline: PipelineLayout, budget: int) -> tuple[list[RankFit], list[str]]:
    """Per rank, the fewest leading layers recomputed (`full`, the rest `none`, as Megatron's `block` recompute method
    chooses them per stage) whose rank_total fits `budget`, found by bisection (the total falls as layers are
    recomputed), each candidate estimated as `estimate_pipeline` estimates a rank; and the whole model's per-block
    plan that puts every rank's choice together (policy=per_block policy.blocks=[...])."""
    n_layer = config.model.n_layer
    plan = ["none"] * n_layer
    fits = []
    for rank in range(pipeline.ranks):
        own = [i for s in pipeline.stages_of(rank) for i in stage_layers(n_layer, pipeline.n_stages, s)]

        def total(k: int, own: list[int] = own, rank: int = rank) -> int:
            blocks = ["full" if i in own[:k] else "none" for i in range(n_layer)]
            cfg = {"name": "per_block", "blocks": blocks}
            return rank_total(_estimate_one(config, pipeline, rank, cfg))

        low, high = 0, len(own)  # the answer lies in [low, high] once `high` fits
        totals = {high: total(high)}
        if totals[high] > budget:
            fits.append(RankFit(rank, high, len(own), totals[high], False))
        else:
            while low < high:
                mid = (low + high) // 2
                totals[mid] = total(mid)
                low, high = (low, mid) if totals[mid] <= budget else (mid + 1, high)
            fits.append(RankFit(rank, high, len(own), totals[high], True))
        for i in own[: fits[-1].recomputed]:
            plan[i] = "full"
    return fits, plan


def estimate_pipeline_rank(config: Any, pipeline: PipelineLayout, rank: int) -> RankPeak:
    """Rank `rank` of `config`'s pipeline under its configured policy, as `estimate_pipeline` estimates each rank
    (a run's own prediction of its rank)."""
    return _estimate_one(config, pipeline, rank, config.policy)


def _estimate_one(config: Any, pipeline: PipelineLayout, rank: int, policy: Any) -> RankPeak:
    from models import build_model
    from trainer.core.schema import model_vocab

    vocab = model_vocab(config)
    return estimate_rank(
        lambda: build_model(config.model, vocab),
        rank,
        pipeline.ranks,
        pipeline.schedule,
        pipeline.n_microbatches,
        (config.batch_size, config.seq_len),
        policy,
        config.loss,
        pipeline.virtual,
        config.optim,
        config.trainer.grad_clip,
    )


def bubble(pipeline: PipelineLayout) -> float:
    """The pipeline's idle share, over its busy time: (p − 1)/m for GPipe and 1F1B, (p − 1)/(v·m) interleaved
    (Narayanan et al. 2021, §2.2), for stages of equal time; the step is the slowest rank's compute × (1 + bubble).
    Interleaved over fewer micro-batches than ranks (torch runs it) idles more than this says."""
    return (pipeline.ranks - 1) / (pipeline.virtual * pipeline.n_microbatches)


def estimate_pipeline(config: Any, pipeline: PipelineLayout) -> list[RankEstimate]:
    """Every rank of `config`'s pipeline (trainer.core.resolve.pipeline_parallel settles `pipeline`), each estimated as
    `estimate_rank` estimates it: the configured model, policy and loss head, `accum` micro-batches of batch_size ×
    seq_len a step. fp32 only (the stages' bare step runs no precision plugin)."""
    ranks = []
    for rank in range(pipeline.ranks):
        ids = pipeline.stages_of(rank)
        figures = estimate_pipeline_rank(config, pipeline, rank)
        layers = [stage_layers(config.model.n_layer, pipeline.n_stages, s) for s in ids]
        ranks.append(RankEstimate(rank, ids, layers, figures))
    return ranks
