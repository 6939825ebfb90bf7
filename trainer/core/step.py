"""The one definition of a training step as Lightning runs it, and of the memory figures taken over it.

Lightning's automatic optimization, for one optimizer step of `accum` micro-batches, does (lightning 2.6,
`_AutomaticOptimization`): for each micro-batch, `training_step` under the precision plugin's forward context
(autocast with its weight cache off for *-mixed), the loss divided by `accum` and a detached copy kept, `zero_grad`
(set_to_none) after the FIRST micro-batch's forward only — so the forward runs with last step's gradients alive —
then backward; after the last backward `on_before_optimizer_step` (the numeric guard's norm), gradient clipping,
`optimizer.step()`, the LR scheduler's step, `on_train_batch_end`. Its data fetcher reads one micro-batch ahead, and
reads it before the batch's start hook: so from the second micro-batch on, each next batch is loaded inside the step
(the last one, the next step's first, lives through the optimizer step).

`bare_step` does exactly that without a Trainer; `StepMeter` takes the two memory figures a run logs at the same
points: the activation peak (`memory/activation_peak_mib`: live-tensor bytes over the first micro-batch's forward and
backward, gradient buffers and the training state left out) and the step's whole peak (`memory/peak_total_mib`:
everything, with the training state adopted). The measuring callback drives a StepMeter from Lightning's hooks, the
estimator drives one from `bare_step` on fake tensors, and the benchmarks and tests from `bare_step` on real ones,
so a figure the estimator prints is the figure a run logs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainer.measure.memory.allocator_events import AllocatorRecorder
from trainer.measure.memory.tracker import LiveTensorTracker
from trainer.parallel import tensor as tensor_parallel

# Labels of what the tracker holds at a moment (StepMeter with regions on): the training state...
PARAMETERS, LAST_GRADIENTS, OPTIMIZER_STATE, GRADIENTS = "parameters", "last_gradients", "optimizer_state", "gradients"
# ...and what the step makes: "embedding", "layer i", "head" (final norm, logits, loss: its forward and its
# backward), "backward" (the layers' backward: gradients in flight, recompute), "later micro-batches" (accum > 1),
# "optimizer" (clipping, the update).
EMBEDDING, HEAD, BACKWARD, LATER, OPTIMIZER = "embedding", "head", "backward", "later micro-batches", "optimizer"


def training_state(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, list[torch.Tensor]]:
    """Every tensor a training step holds before it starts: parameters and buffers, last step's gradients, the
    optimizer state."""
    params = [*module.parameters(), *module.buffers()]
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    state = [v for opt in optimizers for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {PARAMETERS: params, LAST_GRADIENTS: grads, OPTIMIZER_STATE: state}


@dataclass
class StepFigures:
    activation_bytes: int
    total_bytes: int
    # with regions on: live bytes per label at the activation peak, at the step's peak, and at the end of the
    # first forward (per layer: what each keeps for its backward)
    at_activation_peak: dict[str, int] = field(default_factory=dict)
    at_total_peak: dict[str, int] = field(default_factory=dict)
    after_forward: dict[str, int] = field(default_factory=dict)
    head_peak: int = 0  # the most bytes the head (its forward and backward) held at once
    peak_phase: str = ""  # the label of the op that set the activation peak
    total_phase: str = ""  # the label of the op that set the step's peak
    # the tracker's (record, signed bytes) events and the records that predate the step, for an allocator replay
    events: list[tuple[int, int]] = field(default_factory=list)
    adopted: set[int] = field(default_factory=set)


class StepMeter:
    """The memory figures of one optimizer step, taken where the measuring callback takes them.

        meter.begin(module, optimizers)     before the first micro-batch's forward (on_train_batch_start)
        meter.close_window(module)          after the first micro-batch's backward (on_train_batch_end, or
                                            on_before_optimizer_step when accum = 1)
        meter.end(module) -> StepFigures    after the optimizer step (the last on_train_batch_end)

    and, for the breakdown only, `meter.phase(label)` where the step moves on (bare_step calls it).

    `regions=True` labels every storage with what made it (forward hooks on the layers, a tensor hook for the end
    of the head's backward), for the estimator's breakdown; hooks allocate nothing, so the figures are the same.

    `compiled=True` counts what the allocator hands out
    (trainer.measure.memory.allocator_events) instead of tracking dispatched
    ops: under the tracker's dispatch mode dynamo would run a compiled model eagerly. Same figures, same points; no
    regions (the allocator does not say what a block is for).
    """

    WINDOW_END = "window_end"

    def __init__(
        self,
        device_type: str | None,
        regions: bool = False,
        compiled: bool = False,
        tracker: type[LiveTensorTracker] = LiveTensorTracker,
    ) -> None:
        if compiled and (regions or device_type is None):
            raise ValueError("a compiled step is counted on a real device, without regions")
        # `tracker`: the estimator's compiled step passes one that dynamo runs compiled graphs under
        self.tracker = tracker(device=device_type)
        self.recorder = AllocatorRecorder(device_type) if compiled and device_type is not None else None
        self.regions = regions
        self._activation: int | None = None
        self._window_end: int | None = None
        self._forward_end: int | None = None
        self._hooks: list[Any] = []
        self._grads: list[torch.Tensor | None] = []

    def begin(
        self, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], layers: Sequence[nn.Module] = ()
    ) -> None:
        if self.recorder is not None:
            self.recorder.start([t for ts in training_state(module, optimizers).values() for t in ts])
            return
        self.tracker.__enter__()
        for label, tensors in training_state(module, optimizers).items():
            self.tracker.adopt(tensors, label)
        if self.regions:
            self.tracker.region = EMBEDDING
            self._hook_layers(layers)

    def _hook_layers(self, layers: Sequence[nn.Module]) -> None:
        tracker = self.tracker
        last = len(layers) - 1

        def pre(i: int, *_: Any) -> None:
            in_backward = torch._C._current_autograd_node() is not None  # a recompute
            tracker.region = BACKWARD if in_backward else f"layer {i}"

        def post(i: int, _m: Any, _a: Any, out: Any) -> None:
            if torch._C._current_autograd_node() is not None:
                tracker.region = BACKWARD
                return
            tracker.region = HEAD if i == last else f"layer {i + 1}"
            if i == last and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(self._head_backward_done)

        for i, layer in enumerate(layers):
            self._hooks.append(layer.register_forward_pre_hook(lambda *a, i=i: pre(i, *a)))
            self._hooks.append(layer.register_forward_hook(lambda *a, i=i: post(i, *a)))

    def _head_backward_done(self, grad: torch.Tensor) -> None:
        self.tracker.region = BACKWARD

    def phase(self, label: str) -> None:
        """The step moves on to `label` (bare_step: head's backward, later micro-batches, optimizer)."""
        if self.recorder is not None:
            return
        if self._forward_end is None and label == HEAD:
            self._forward_end = self.tracker.mark()  # the first forward is done: what each layer keeps
        if self.regions:
            self.tracker.region = label

    def close_window(self, module: nn.Module) -> None:
        if self._activation is not None:
            return
        self._grads = [p.grad for p in module.parameters()]
        if self.recorder is not None:
            self.recorder.mark(self.WINDOW_END, self._grads)
            self._activation = 0  # taken from the recording at the end
            return
        self._window_end = self.tracker.mark()
        self._activation = self.tracker.peak_bytes_excluding(self._grads, until=self._window_end)

    def abort(self) -> None:
        """A step that failed midway: leave the tracker's mode and the hooks, so nothing stays installed (the
        dispatch-mode stack is LIFO: a mode left behind would be popped in place of the one above it)."""
        if self.recorder is not None:
            self.recorder.abort()
        if self.tracker._active:
            self.tracker.__exit__(None, None, None)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def end(self, module: nn.Module) -> StepFigures:
        self.close_window(module)
        if self.recorder is not None:
            rec = self.recorder.stop()
            grads = rec.records_at(self.WINDOW_END, self._grads)
            activation = rec.peak(excluding=grads, until=self.WINDOW_END, adopted=False)
            return StepFigures(activation, rec.peak(), events=rec.events, adopted=rec.adopted)
        tracker = self.tracker
        tracker.__exit__(None, None, None)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        figures = StepFigures(activation_bytes=int(self._activation or 0), total_bytes=tracker.peak_bytes)
        figures.events, figures.adopted = tracker._window.events, set(tracker._window.adopted)
        if self.regions:
            window = tracker._window
            grads = tracker.records_of(p.grad for p in module.parameters())
            tracker.relabel(grads, GRADIENTS)
            excluded = set(window.adopted) | tracker.records_of(self._grads)
            _, act_at = tracker.peak_at(excluding=excluded, until=self._window_end)
            _, total_at = tracker.peak_at()
            figures.at_activation_peak = tracker.live_by_label(act_at, excluding=excluded)
            figures.at_total_peak = tracker.live_by_label(total_at)
            if self._forward_end is not None:
                figures.after_forward = tracker.live_by_label(self._forward_end, excluding=excluded)
            not_head = {r for r in range(window.next_record) if window.labels.get(r) != HEAD}
            figures.head_peak, _ = tracker.peak_at(excluding=not_head, until=self._window_end)
            if act_at:
                record = window.events[act_at - 1][0]
                figures.peak_phase = window.labels.get(record, "other")
            if total_at:
                figures.total_phase = window.labels.get(window.events[total_at - 1][0], "other")
        return figures


def bare_step(
    module: Any,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    precision_plugin: Any,
    grad_clip: float = 0.0,
    meter: StepMeter | None = None,
    layers: Sequence[nn.Module] = (),
    on_forward: Callable[[], None] | None = None,
    before_update: Callable[[], None] | None = None,
) -> torch.Tensor:
    """One optimizer step over `batches` (its micro-batches) exactly as Lightning runs it; returns the mean loss.

    `module.loss_of(batch)` is the forward `training_step` runs. `meter` takes the run's memory figures; `layers`
    (the decoder's) label them by layer when the meter has regions on. `on_forward` runs after the first forward,
    `before_update` after the last backward (the gradients complete, before clipping).
    """
    accum = len(batches)
    params = [p for p in module.parameters() if p.requires_grad]
    scaler = getattr(precision_plugin, "scaler", None)  # 16-mixed: the plugin's GradScaler, used as Lightning does
    losses = []
    ahead: tuple[torch.Tensor, ...] | None = None  # the batch the fetcher read ahead, inside this step
    for i, batch in enumerate(batches):
        if i == 0 and meter is not None:
            meter.begin(module, [optimizer], layers)
        if i > 0:
            batch = ahead if ahead is not None else batch
            ahead = tuple(t.clone() for t in batches[(i + 1) % accum])  # a fresh copy, as a loader makes one
        with precision_plugin.forward_context():
            loss = module.loss_of(batch)
        # What training_step keeps alive until the next micro-batch's: the loss itself (module.last_loss, for the
        # numeric guard) and self.log's copy of it (Lightning's on-step cache of a logged tensor is a clone).
        held = (loss.detach(), loss.detach().clone())
        closure_loss = loss / accum  # Lightning's ClosureResult: normalised by accumulate_grad_batches
        losses.append(closure_loss.detach().clone())
        del loss
        if i == 0:
            if on_forward is not None:
                on_forward()
            optimizer.zero_grad(set_to_none=True)
            if meter is not None:
                meter.phase(HEAD)  # its backward starts with the head's
        with tensor_parallel.loss_context(module.model):  # as DecoderModule.backward runs it
            (closure_loss if scaler is None else scaler.scale(closure_loss)).backward()
        del closure_loss
        if meter is not None and i < accum - 1:
            meter.close_window(module)  # on_train_batch_end of the first micro-batch
            meter.phase(LATER)
    if scaler is not None:
        scaler.unscale_(optimizer)  # MixedPrecision.optimizer_step: unscaled before the hook and clipping
    if meter is not None:
        meter.close_window(module)  # on_before_optimizer_step
        meter.phase(OPTIMIZER)
    if before_update is not None:
        before_update()
    optimizer_phase(params, optimizer, grad_clip, scaler, scheduler)
    del held  # through the update, as the run holds them
    return torch.stack(losses).sum()


def optimizer_phase(
    params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    grad_clip: float = 0.0,
    scaler: Any = None,
    scheduler: Any = None,
) -> None:
    """What follows the last backward: the numeric guard's gradient norm, clipping, the optimizer step (through the
    16-mixed plugin's GradScaler when there is one), the LR scheduler's step."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch.nn.utils.get_total_norm(grads, norm_type=2.0)  # the numeric guard's gradient norm
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)  # skipped on inf/NaN gradients
        scaler.update()
    if scheduler is not None:
        scheduler.step()


def optimizers_of(module: Any) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer and LR scheduler `module.configure_optimizers()` returns (Lightning's dict form)."""
    out = module.configure_optimizers()
    if isinstance(out, dict):
        sched = out.get("lr_scheduler")
        return out["optimizer"], sched["scheduler"] if isinstance(sched, dict) else sched
    return out, None
