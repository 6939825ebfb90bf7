"""The planner's measuring half: one micro-batch of the real model, block by block, into a Profile.

What is measured (LiveTensorTracker, so CPU and CUDA alike; the budget is MiB of the same whole-step figure the
measuring callback reports as `peak_total_mib`):

* per block and treatment, the block run alone on its real input and with the arguments the model passes it (its
  context: rotary table, mask), under the treatment, installed as training installs it (`install_plan` with a
  plan that gives this block the treatment and every other block `none`): the bytes it keeps from its forward
  until its backward (its input included, its output left to the next block), before and after autocast lets go of
  its weight copies; the peak of its forward; the extra bytes at the peak of its backward (recompute, gradients in
  flight, its parameters' new gradients); and its forward and backward time (the median of `repeats` rounds after
  `warmup`, each round running every treatment once, order rotated), measured once per group of blocks of identical
  structure, whose bytes and times are identical too; on fake tensors the times are the step-time model's
  prediction (trainer.measure.time.roofline) for the device the estimate is for;
* the rest of the model (embedding and loss head) in the same way, with the block stack cut out, once per loss
  head the planner may choose;
* the training state: parameters and buffers, gradients, optimizer state (a throw-away optimizer of the run's
  kind with lr=0 on the real parameters, so nothing changes), and the peak of the step's optimizer phase
  (`trainer.core.step.optimizer_phase`: the guard's norm, clipping, the update).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models.adapter import DecoderAdapter, adapter_for
from trainer import precision as precision_
from trainer.core.step import optimizer_phase
from trainer.measure.fake.compiled import GraphOpTrace, GraphTracker, fake_compiled_runtime, run_generated_code
from trainer.measure.memory.tracker import LiveTensorTracker, local_tensors
from trainer.measure.time.calibration import speed_for
from trainer.measure.time.op_trace import OpTrace, trace
from trainer.measure.time.roofline import Speed
from trainer.parallel import tensor as tensor_parallel
from trainer.planner.peak import Cost, Profile
from trainer.policies import Plan, Policy, build_policy, install_plan, remove_policy

Batch = tuple[torch.Tensor, torch.Tensor]
LayerArgs = tuple[tuple[Any, ...], dict[str, Any]]  # a layer's arguments after the hidden states


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _storage_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else _unique_bytes([t])


def _unique_bytes(tensors: Sequence[torch.Tensor | None]) -> int:
    """The bytes the tensors' storages hold, each storage once: a DTensor's are its local shard's (FSDP2's and tensor
    parallelism's; its own storage reports the global size)."""
    seen: dict[int, int] = {}
    for t in local_tensors(tensors):
        s = t.untyped_storage()
        seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def _block_signature(block: nn.Module) -> tuple[Any, ...]:
    """Blocks with equal signatures have byte-identical profiles (same code, shapes, dtypes, options)."""
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters())
    bufs = tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers())
    opts = tuple(
        (n, type(m).__name__, getattr(m, "p", None), getattr(m, "attention", None)) for n, m in block.named_modules()
    )
    return params, bufs, opts


@dataclass
class _Timer:
    """Median wall time of a few repetitions (CUDA-synchronised)."""

    device: torch.device

    def __call__(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        _sync(self.device)
        t0 = time.perf_counter()
        out = fn()
        _sync(self.device)
        return out, (time.perf_counter() - t0) * 1e3


@dataclass
class _RooflineClock:
    """The planner's clock on fake tensors: the ops run, costed by the step-time model (trainer.measure.time.roofline)
    against the device the estimate is for; `compiled`: a compiled block's generated code, its fused kernels each
    one op (trainer.measure.fake.compiled)."""

    speed: Speed
    compiled: bool = False

    def __call__(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        out, work = trace(fn, GraphOpTrace if self.compiled else OpTrace)
        return out, self.speed.predict(work).ms


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _peak_since(tracker: LiveTensorTracker, n: int, floor: int) -> int:
    return max([floor] + [p.live_bytes for p in tracker.timeline[n:]])


@dataclass
class _Run:
    """What every measurement of one profile shares: the model, how a forward runs, the clock, the repetitions."""

    adapter: DecoderAdapter
    forward_context: Callable[[], Any]
    timer: Any
    repeats: int
    device_type: str
    timing: bool
    warmup: int = 1
    compiled: bool = False  # each block compiled as trainer.compile=true compiles the model (on fake tensors)

    @property
    def rounds(self) -> int:
        """Timed rounds: a clock of FLOPs and bytes (fake tensors) gives the same figure every time."""
        return (1 if isinstance(self.timer, _RooflineClock) else self.repeats) if self.timing else 0

    def tracker(self) -> LiveTensorTracker:
        kind = GraphTracker if self.compiled else LiveTensorTracker
        return kind(record_timeline=True, device=self.device_type)

    def median_ms(self, fn: Callable[[], float]) -> float:
        if not self.rounds:
            return 0.0
        for _ in range(self.warmup if self.rounds > 1 else 0):
            fn()
        return statistics.median([fn() for _ in range(self.rounds)])


def _run_block(
    run: _Run,
    layer: nn.Module,
    x_src: torch.Tensor,
    context: LayerArgs,
    w: torch.Tensor,
    tracker: LiveTensorTracker | None,
) -> dict[str, float]:
    """Forward (in the precision plugin's forward context) then backward of one layer on a copy of its real input,
    called with the arguments the model passes it.

    The backward's seed is `(y * w).sum()`: autograd makes the incoming gradient (as the next block would hand
    it over) and nothing in Python holds it, so it is freed as it would be in the chain.
    """
    out: dict[str, float] = {}
    x = x_src.detach().clone().requires_grad_(True)
    args, kwargs = context
    n0 = len(tracker.timeline) if tracker else 0
    start = tracker.live_bytes if tracker else 0

    def forward() -> torch.Tensor:
        with run.forward_context():
            y = layer(x, *args, **kwargs)
            if tracker:
                out["end_fwd"] = tracker.live_bytes
        return y

    y, out["fwd_ms"] = run.timer(forward)
    if tracker:
        out["fwd_peak"] = _peak_since(tracker, n0, start)
        out["after_exit"] = tracker.live_bytes
        out["y"] = _storage_bytes(y)
    seed = (y * w).sum()
    n1 = len(tracker.timeline) if tracker else 0
    level = tracker.live_bytes if tracker else 0
    _, out["bwd_ms"] = run.timer(seed.backward)
    if tracker:
        out["bwd_peak"] = _peak_since(tracker, n1, level)
    return out


def profile(
    model: nn.Module,
    batch: Batch,
    *,
    loss_fn: Callable[[Batch], torch.Tensor] | Mapping[str, Callable[..., torch.Tensor]],
    precision: str,
    make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
    param_groups: list[dict[str, Any]] | None = None,
    accum: int = 1,
    treatments: Sequence[str] = ("none", "selective", "op_sac", "full"),
    policy: Policy | None = None,
    repeats: int = 5,
    grad_clip: float = 0.0,
    timing: bool = True,
    resident: Sequence[torch.Tensor] = (),
    warmup: int = 1,
    speed: Speed | None = None,
    compiled: bool = False,
) -> Profile:
    """Measure what the planner needs on one micro-batch (see the module docstring).

    `model` meets the decoder contract (models/adapter.py); its installed policy is removed (the caller installs
    the plan). `loss_fn(batch)` is the training forward (the module's `loss_of`), or {loss name: loss_fn}: the
    embedding and head are then profiled under each and the Profile's `heads` holds one Profile per name (the
    first is this one). `policy`: the policy whose treatment parameters the blocks run with (auto's `params`).
    `make_optimizer(groups)` builds an optimizer of the run's kind; it is given lr=0 groups over the real
    parameters and stepped on zero gradients, which leaves every parameter bit-for-bit as it was. The caller
    restores RNG state if it matters (dropout draws from it). `resident`: training-state tensors already on the
    device that the profile measures anyway (a resumed run's optimizer state), so that they are not also counted as
    memory the tracker cannot see (CUDA). Times: on real tensors, `warmup` untimed rounds then the median of
    `repeats` rounds, each round running every treatment once (order rotated, so a shared machine's drift falls on
    all alike); on fake tensors the step-time model's prediction for `speed` (default: this CPU calibrated, or
    the reference GPU for a CUDA estimate). `compiled` (fake tensors only): each block under each treatment compiled
    by inductor as trainer.compile=true compiles the model (trainer.measure.fake.compiled), so its bytes and times are
    the compiled block's; the embedding, head and optimizer stay eager, as a run compiles only the decoder.
    """
    policy = policy or build_policy({"name": "per_block", "pattern": ["none"]})
    losses = dict(loss_fn) if isinstance(loss_fn, Mapping) else {"": loss_fn}
    device = batch[0].device
    fake = _is_fake(batch[0])
    if compiled and not fake:
        raise ValueError("a compiled profile is taken on fake tensors (the estimator's compiled step)")
    adapter = adapter_for(model)
    run = _Run(
        adapter=adapter,
        forward_context=precision_.plugin(precision, device.type).forward_context,
        timer=_RooflineClock(speed or speed_for(device.type), compiled) if fake and timing else _Timer(device),
        repeats=repeats,
        device_type=device.type,
        timing=timing,
        warmup=warmup,
        compiled=compiled,
    )
    params = list(model.parameters())
    saved_grads = [p.grad for p in params]
    was_training = model.training
    remove_policy(model)
    model.train()
    try:
        for p in params:
            p.grad = None
        with fake_compiled_runtime() if compiled else contextlib.nullcontext():
            blocks = _profile_blocks(run, batch, next(iter(losses.values())), treatments, policy)
        rests = {name: _profile_rest(run, batch, fn) for name, fn in losses.items()}
        opt = _profile_optimizer(run, make_optimizer, param_groups, grad_clip)
    finally:
        for p, g in zip(params, saved_grads, strict=True):
            p.grad = g
        remove_policy(model)
        model.train(was_training)
    untracked = 0
    if device.type == "cuda" and not fake:
        state = [*model.parameters(), *model.buffers(), *resident]
        untracked = max(0, torch.cuda.memory_allocated(device) - _unique_bytes(state))
    shape = {
        "micro_batch": batch[0].shape[0],
        "seq_len": batch[0].shape[1],
        "accum": accum,
        "precision": precision,
        "device": device.type,
        "untracked": untracked,
    }
    notes = [f"step times predicted for {run.timer.speed.name}"] if isinstance(run.timer, _RooflineClock) else []
    if compiled:
        notes.append("blocks compiled by inductor, each alone, as trainer.compile=true compiles them (fake tensors)")
    prof = _assemble(treatments, blocks, rests, opt, shape, policy, notes)
    if run.rounds > 1:
        _in_the_chain(run, prof, batch, next(iter(losses.values())), policy)
    if not fake and timing:
        _no_faster_than_none(prof)
    return prof


def _no_faster_than_none(prof: Profile) -> None:
    """Hold each treatment's forward and backward time at least at none's, block by block.

    Every treatment runs none's forward and none's backward and adds to them (a recompute, a copy), so one the clock
    saw faster than none saw noise: on a small block the clock's spread exceeds the work a treatment adds, and the
    planner would take a recompute plan at a budget that fits none. Held, such a treatment ties with none, and the
    planner breaks ties toward none (PeakModel.solve). Predicted times (fake tensors) already count the extra work.
    """
    held: set[str] = set()
    for costs in prof.costs:
        none = costs.get("none")
        if none is None:
            return
        for t, c in costs.items():
            if c.fwd_ms < none.fwd_ms or c.bwd_ms < none.bwd_ms:
                costs[t] = dataclasses.replace(c, fwd_ms=max(c.fwd_ms, none.fwd_ms), bwd_ms=max(c.bwd_ms, none.bwd_ms))
                held.add(t)
    if held:
        prof.notes.append(f"timed faster than none, held at none's time: {', '.join(sorted(held))}")


def _chainable(prof: Profile, t: str, device: torch.device) -> bool:
    """Whether the whole stack under `t` can run here: on CUDA only where its predicted peak fits what is free."""
    if device.type != "cuda":
        return True
    from trainer.planner.peak import PeakModel

    free, _ = torch.cuda.mem_get_info(device)
    peak = PeakModel(prof).evaluate([t] * prof.n_layer).peak
    return peak - torch.cuda.memory_allocated(device) <= 0.9 * free


def _in_the_chain(run: _Run, prof: Profile, batch: Batch, loss_fn: Callable[..., torch.Tensor], policy: Policy) -> None:
    """Block times as the step sees them: a block timed alone runs on data its forward left in cache, where in the
    step the other blocks' work comes between its forward and its backward. So the whole model runs, forward and
    backward, under each uniform plan that fits (rounds interleaved, after the warm-up); its time less the rest's
    (embedding, head) is the blocks' share, and each treatment's blocks are scaled to it (a treatment that cannot run
    whole takes the others' mean scale). The blocks' bytes are left as measured."""
    adapter, L = run.adapter, prof.n_layer
    device = batch[0].device
    chained = [t for t in prof.treatments if _chainable(prof, t, device)]
    if not chained:
        return
    params = list(adapter.model.parameters())
    saved = [p.grad for p in params]
    times: dict[str, list[float]] = {t: [] for t in chained}

    def once(t: str) -> float:
        install_plan(adapter, Plan.per_block([t] * L), policy)
        try:

            def fwd_bwd() -> None:
                with run.forward_context():
                    loss = loss_fn(batch)
                with tensor_parallel.loss_context(adapter.model):
                    loss.backward()

            _, ms = run.timer(fwd_bwd)
        finally:
            remove_policy(adapter.model)
            for p in params:
                p.grad = None
        return ms

    try:
        for p in params:
            p.grad = None
        for r in range(run.warmup + run.rounds):
            k = r % len(chained)
            for t in chained[k:] + chained[:k]:
                ms = once(t)
                if r >= run.warmup:
                    times[t].append(ms)
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
    scale: dict[str, float] = {}
    for t in chained:
        alone = sum(prof.costs[i][t].ms for i in range(L))
        blocks = statistics.median(times[t]) - prof.rest_ms
        if alone > 0 and blocks > 0:  # a clock too coarse to see the blocks (a test's) leaves them as timed alone
            scale[t] = blocks / alone
    mean = statistics.mean(scale.values()) if scale else 1.0
    for costs in prof.costs:
        for t, c in costs.items():
            f = scale.get(t, mean)
            costs[t] = dataclasses.replace(c, fwd_ms=c.fwd_ms * f, bwd_ms=c.bwd_ms * f)
    prof.notes.append(
        "block times scaled to the whole stack's under each uniform plan: "
        + ", ".join(f"{t} ×{f:.2f}" for t, f in scale.items())
    )


def _assemble(
    treatments: Sequence[str],
    blocks: dict[str, Any],
    rests: dict[str, dict[str, Any]],
    opt: dict[str, Any],
    shape: dict[str, Any],
    policy: Policy,
    notes: list[str],
) -> Profile:
    """One Profile per loss head (its embedding and head figures), the blocks and the training state shared; the
    first head's Profile holds them all in `heads`."""
    common = {
        "treatments": tuple(treatments),
        **blocks,
        "params": opt["params"],
        "grads": opt["grads"],
        "optimizer": opt["optimizer"],
        "opt_peak": opt["peak"],
        "opt_ms": opt["ms"],
        **shape,
        "prefetch": bool(policy.treatment_policy("offload").cfg.prefetch),
    }
    profiles = {
        name: Profile(
            **common, **{k: v for k, v in rest.items() if k != "ms"}, rest_ms=rest["ms"], loss=name, notes=list(notes)
        )
        for name, rest in rests.items()
    }
    primary = next(iter(profiles.values()))
    primary.heads = profiles
    return primary


def _block_inputs(
    run: _Run, batch: Batch, loss_fn: Callable[..., Any], firsts: set[int]
) -> tuple[dict[int, torch.Tensor], list[LayerArgs]]:
    """One no-grad pass over the micro-batch: the real input of the layers in `firsts`, and every layer's
    arguments (its context), as the model's own loop passes them."""
    inputs: dict[int, torch.Tensor] = {}
    contexts: list[LayerArgs] = [((), {}) for _ in range(run.adapter.n_layer)]

    def record(i: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if i in firsts:
            inputs[i] = args[0].detach()
        contexts[i] = (tuple(args[1:]), dict(kwargs))

    hooks = [
        layer.register_forward_pre_hook(functools.partial(record, i), with_kwargs=True)
        for i, layer in enumerate(run.adapter.layers)
    ]
    try:
        with torch.no_grad(), run.forward_context():
            loss_fn(batch)
    finally:
        for h in hooks:
            h.remove()
    return inputs, contexts


class _BlockBench:
    """Blocks under treatments, each installed through the normal path: a full-length plan that gives block i the
    treatment and every other block `none` (which installs nothing)."""

    def __init__(self, run: _Run, policy: Policy, inputs: dict[int, torch.Tensor], contexts: list[LayerArgs]) -> None:
        self.run, self.policy, self.inputs, self.contexts = run, policy, inputs, contexts
        self.blocks = list(run.adapter.layers)
        self.seed_w = torch.randn_like(inputs[0], dtype=torch.float32)  # the backward seed's weights: (y * w).sum()

    def install(self, i: int, t: str) -> None:
        n = self.run.adapter.n_layer
        install_plan(self.run.adapter, Plan.per_block(["none"] * i + [t] + ["none"] * (n - i - 1)), self.policy)
        if self.run.compiled:
            # dynamo's caches emptied first: one block's code under many treatments would pile up guards until its
            # recompile limit silently ran the block eagerly
            torch._dynamo.reset()
            backend = self.policy.treatment_policy(t).compile_backend(run_generated_code)
            self.blocks[i].compile(backend=backend)
            self.once(i, i)  # compiles it (forward and backward), outside any clock or tracker
            self.clear_grads([i])

    def uninstall(self, i: int) -> None:
        self.run.adapter.override_forward(i, None)
        self.run.adapter.wrap_core_attention(i, None)
        if self.run.compiled:
            self.blocks[i]._compiled_call_impl = None

    def clear_grads(self, members: Sequence[int]) -> None:
        for i in members:
            for p in self.blocks[i].parameters():
                p.grad = None

    def once(self, i: int, x_from: int, tracker: LiveTensorTracker | None = None) -> dict[str, float]:
        return _run_block(self.run, self.blocks[i], self.inputs[x_from], self.contexts[i], self.seed_w, tracker)

    def measure(self, members: Sequence[int], t: str) -> dict[str, Any]:
        """The bytes of the group's first block under `t`, after a warm-up run (lazy init, SAC contexts,
        allocator); `warm_ms`: the warm-up run's forward and backward time."""
        first = members[0]
        self.install(first, t)
        try:
            warm = self.once(first, first)
            self.clear_grads([first])
            tracker = self.run.tracker()
            with tracker:
                return {**self.once(first, first, tracker), "warm_ms": (warm["fwd_ms"], warm["bwd_ms"])}
        finally:
            self.uninstall(first)
            self.clear_grads(members)

    def time_rounds(
        self, firsts: Sequence[int], treatments: Sequence[str]
    ) -> dict[tuple[int, str], tuple[float, float]]:
        """Forward and backward time of each (group's first block, treatment): `warmup` untimed rounds, then the
        median of the timed ones; every round runs each pair once, the order rotated by the round."""
        pairs = [(i, t) for i in firsts for t in treatments]
        runs: dict[tuple[int, str], list[dict[str, float]]] = {pair: [] for pair in pairs}
        rounds = self.run.rounds
        warmup = self.run.warmup if rounds > 1 else 0
        for r in range(warmup + rounds):
            k = r % len(pairs)
            for i, t in pairs[k:] + pairs[:k]:
                self.install(i, t)
                try:
                    m = self.once(i, i)
                finally:
                    self.uninstall(i)
                    self.clear_grads([i])
                if r >= warmup:
                    runs[(i, t)].append(m)
        return {
            pair: (statistics.median(m["fwd_ms"] for m in ms), statistics.median(m["bwd_ms"] for m in ms))
            if ms
            else (0.0, 0.0)
            for pair, ms in runs.items()
        }


def _cost(m: dict[str, float], none: dict[str, float] | None, t: str, times: tuple[float, float]) -> Cost:
    y = int(m["y"])
    kept = int(m["after_exit"]) - y
    # offload: what comes back is the bytes `none` keeps less those left on the device
    restored = max(0, int(none["after_exit"]) - int(m["after_exit"])) if t == "offload" and none else 0
    return Cost(
        kept_fwd=int(m["end_fwd"]) - y,
        kept=kept,
        fwd_peak=int(m["fwd_peak"]),
        transient=int(m["bwd_peak"]) - y - kept,
        restored=restored,
        fwd_ms=times[0],
        bwd_ms=times[1],
    )


def _profile_blocks(
    run: _Run, batch: Batch, loss_fn: Callable[..., Any], treatments: Sequence[str], policy: Policy
) -> dict[str, Any]:
    """Costs per block and treatment, measured once per group of identical blocks, on the group's first block's
    real input (a group's other blocks are timed on that same input: their bytes and times do not depend on the
    values)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, b in enumerate(run.adapter.layers):
        groups.setdefault(_block_signature(b), []).append(i)
    inputs, contexts = _block_inputs(run, batch, loss_fn, {members[0] for members in groups.values()})
    bench = _BlockBench(run, policy, inputs, contexts)
    # offload's prefetch brings back what `none` would keep: measure `none`'s bytes even when it is no candidate
    measured = tuple(treatments) + (("none",) if "offload" in treatments and "none" not in treatments else ())
    costs: list[dict[str, Cost]] = [{} for _ in bench.blocks]
    # A clock of FLOPs and bytes gives the warm-up run's time every time: the block is not installed (compiled,
    # under compile) again to be timed.
    deterministic = isinstance(run.timer, _RooflineClock) and run.rounds == 1
    firsts = [members[0] for members in groups.values()]
    times = {} if deterministic else bench.time_rounds(firsts, treatments)
    for members in groups.values():
        results = {t: bench.measure(members, t) for t in measured}
        none = results.get("none")
        for t in treatments:
            timed = results[t]["warm_ms"] if deterministic else times[(members[0], t)]
            cost = _cost(results[t], none, t, timed)
            for i in members:
                costs[i][t] = cost
    block_grads = [_unique_bytes([p for p in b.parameters() if p.requires_grad]) for b in bench.blocks]
    return {"costs": costs, "block_grads": block_grads, "x_bytes": _storage_bytes(inputs[0])}


def _segmented(
    run: _Run, batch: Batch, loss_fn: Callable[..., torch.Tensor], tracker: LiveTensorTracker | None
) -> dict[str, Any]:
    """The model with its layers cut out: embedding → (cut) → loss head, forward then backward.

    At the cut (the first layer's call) the embedding's output x0 is kept and a fresh leaf h stands in for the last
    layer's output; the other layers pass it through. The head's backward stops at h, and x0.backward(h.grad) runs
    the embedding's. Live bytes are read at each phase.
    """
    adapter = run.adapter
    marks: dict[str, Any] = {}
    held: dict[str, torch.Tensor] = {}

    def cut(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        held["x0"] = x
        if tracker:
            marks["gap_fwd"] = tracker.live_bytes
            marks["n_cut"] = len(tracker.timeline)
        held["h"] = h = x.detach().clone().requires_grad_(True)
        return h

    for i in range(adapter.n_layer):
        adapter.override_forward(i, cut if i == 0 else lambda x, *a, **k: x)
    try:

        def forward() -> torch.Tensor:
            with run.forward_context():
                return loss_fn(batch)

        loss, fwd_ms = run.timer(forward)
    finally:
        for i in range(adapter.n_layer):
            adapter.override_forward(i, None)
    if tracker:
        marks["embed_fwd_peak"] = max(p.live_bytes for p in tracker.timeline[: marks["n_cut"]])
        marks["head_fwd_peak"] = max(p.live_bytes for p in tracker.timeline[marks["n_cut"] :])
        n1, level = len(tracker.timeline), tracker.live_bytes
    with tensor_parallel.loss_context(adapter.model):  # split logits' cross-entropy: its backward under it too
        _, head_ms = run.timer(loss.backward)
    del loss
    if tracker:
        marks["head_bwd_peak"] = _peak_since(tracker, n1, level)
        marks["gap_bwd"] = tracker.live_bytes
    h = held.pop("h")
    g, h.grad = h.grad, None
    del h
    x0 = held.pop("x0")
    if tracker:
        n2, level = len(tracker.timeline), tracker.live_bytes
    _, embed_ms = run.timer(lambda: x0.backward(g))
    if tracker:
        marks["embed_bwd_peak"] = _peak_since(tracker, n2, level)
    marks["ms"] = fwd_ms + head_ms + embed_ms
    return marks


def _profile_rest(run: _Run, batch: Batch, loss_fn: Callable[..., torch.Tensor]) -> dict[str, Any]:
    """The embedding and the loss head: a warm-up, the tracked run, then the timed ones (fresh gradients each)."""
    params = list(run.adapter.model.parameters())

    def fresh() -> None:
        for p in params:
            p.grad = None

    _segmented(run, batch, loss_fn, None)
    fresh()
    tracker = run.tracker()
    with tracker:
        out = _segmented(run, batch, loss_fn, tracker)

    def timed() -> float:
        fresh()
        return _segmented(run, batch, loss_fn, None)["ms"]

    out["ms"] = run.median_ms(timed)
    fresh()
    keys = ("embed_fwd_peak", "gap_fwd", "head_fwd_peak", "head_bwd_peak", "gap_bwd", "embed_bwd_peak", "ms")
    return {k: out[k] for k in keys}


def _profile_optimizer(
    run: _Run,
    make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
    param_groups: list[dict[str, Any]] | None,
    grad_clip: float,
) -> dict[str, Any]:
    """Training-state bytes and the peak of the step's optimizer phase, on the real parameters at lr=0."""
    model = run.adapter.model
    params = [p for p in model.parameters() if p.requires_grad]
    groups = param_groups or [{"params": params}]
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"]), "lr": 0.0} for g in groups]
    opt = make_optimizer(groups)
    for p in params:
        p.grad = torch.zeros_like(p)

    def step() -> None:
        optimizer_phase(params, opt, grad_clip)

    step()  # creates the optimizer state
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    train_state = [*model.parameters(), *model.buffers()]
    grads = [p.grad for p in params]
    out: dict[str, Any] = {
        "params": _unique_bytes(train_state),
        "grads": _unique_bytes(grads),
        "optimizer": _unique_bytes(state),
    }
    tracker = LiveTensorTracker(device=run.device_type)
    with tracker:
        tracker.adopt([*train_state, *grads, *state])
        step()
    out["peak"] = tracker.peak_bytes
    out["ms"] = run.median_ms(lambda: run.timer(step)[1])
    for p in params:
        p.grad = None
    return out
