"""The memory-budget planner behind `policy=auto`: profile one real micro-batch, solve exactly, explain.

    profile(model, batch, ...)  -> Profile      what each block keeps and needs under each treatment, measured
    PeakModel(profile)                          the step's whole peak of any per-block plan, from those figures
      .solve(budget)            -> Solution     the fastest plan whose predicted peak fits (exact DP)
      .min_peak()               -> Solution     the most frugal plan (for the refusal line)
    plan_model(...)             -> PlanResult   profile + solve (+ allow_accum) or a one-line PolicyError
    plan_for_config(config)     -> (Plan, loss head, text)  the same on a freshly built model and a random batch:
                                                the estimator

What is measured (LiveTensorTracker, so CPU and CUDA alike; the budget is MiB of the same whole-step figure the
measuring callback reports as `peak_total_mib`):

* per block and treatment, the block run alone on its real input and with the arguments the model passes it (its
  context: rotary table, mask), under the treatment (`install_plan` with a one-block plan, exactly what training
  installs, through the decoder contract): the bytes it keeps from its forward until its
  backward (its input included, its output left to the next block), before and after autocast lets go of its
  weight copies; the peak of its forward; the extra bytes at the peak of its backward (recompute, gradients in
  flight, its parameters' new gradients); and its forward and backward time (median of `repeats`, pooled over
  blocks of identical structure, whose bytes are identical too and are measured once);
* the rest of the model (embedding and loss head) in the same way, with the block stack cut out, once per loss
  head the planner may choose (`policy.loss_candidates`: the configured loss first);
* the training state: parameters and buffers, gradients, optimizer state (a throw-away optimizer of the run's
  kind with lr=0 on the real parameters, so nothing changes), and the peak of clipping + the optimizer step.

The peak model follows the step as Lightning runs it: the forward runs with last step's gradients still alive
(`zero_grad` comes after `training_step`), the backward frees block i's kept bytes and creates its gradients
(with accumulation, micro-batches after the first run with every gradient alive), then the optimizer step.
The peak is the largest of: the forward of block i (fixed + what blocks before i keep + block i's forward peak),
the loss head, the backward of block i (fixed + what blocks up to i keep + block i's transient + the gradients of
the blocks after it), the embedding's backward and the optimizer step: block i's recompute coexists with what
blocks 0..i keep, not with everything, and the forward, where last step's gradients are still alive, is a phase of
its own. The solver is exact for this model: a dynamic programme over blocks whose state is (bytes kept in
forward, bytes kept to backward) of the blocks so far, keeping the fastest partial plan per state; every
constraint depends only on those sums, so nothing optimal is ever dropped (tests/test_planner.py checks it
against brute force).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from models.adapter import DecoderAdapter, adapter_for
from trainer import precision as precision_
from trainer.memory import MIB, LiveTensorTracker
from trainer.policies import POLICIES, Plan, PolicyError, build_policy, install_plan, remove_policy

log = logging.getLogger(__name__)
# Lightning's per-step scalars (the closure's loss / accum, logged values, norms) that a bare loop does not make:
# measured within ±1.2 KiB of the model on CPU runs; this is headroom for them.
BOOKKEEPING = 16 * 1024


# ----------------------------------------------------------------------------------------------------
# What the profile holds.
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cost:
    """One block under one treatment, measured. Bytes are live-tensor bytes on the training device."""

    kept_fwd: int  # what the block leaves alive at the end of its forward (input in, output out), weight copies in
    kept: int  # what it keeps until its backward: kept_fwd less the weight copies autocast lets go of
    fwd_peak: int  # its forward's peak (input, internals, output)
    transient: int  # extra bytes above `kept` at its backward's peak (recompute, grads in flight, new param grads)
    restored: int = 0  # offload: bytes brought back to the device in backward (prefetched during the next block's)
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0

    @property
    def ms(self) -> float:
        return self.fwd_ms + self.bwd_ms


@dataclass
class Profile:
    """Everything the peak model and the step-time model need, from one micro-batch."""

    treatments: tuple[str, ...]
    costs: list[dict[str, Cost]]  # per block
    block_grads: list[int]  # bytes of each block's parameter gradients
    params: int  # parameters and buffers
    grads: int  # every parameter gradient
    optimizer: int  # optimizer state
    x_bytes: int  # one residual-stream tensor (a block's input)
    # The rest of the model (embedding, loss head), live bytes of the segmented run (x0 and the head input held):
    embed_fwd_peak: int
    gap_fwd: int  # at the cut, going forward: what the embedding keeps + x0
    head_fwd_peak: int
    head_bwd_peak: int
    gap_bwd: int  # at the cut, going backward: + head gradients, the head input and its gradient
    embed_bwd_peak: int
    opt_peak: int  # absolute: training state + clipping + the optimizer step
    micro_batch: int
    seq_len: int
    accum: int
    precision: str
    device: str
    prefetch: bool = True
    untracked: int = 0  # CUDA: allocations the tracker cannot see (cuBLAS workspace, ...), held throughout
    extra: int = 0  # a re-plan's measured excess, added to every phase
    rest_ms: float = 0.0  # embedding + head, forward + backward
    opt_ms: float = 0.0  # clipping + optimizer step
    notes: list[str] = field(default_factory=list)
    loss: str = ""  # the loss head the embedding/head figures were measured with
    heads: dict[str, Profile] = field(default_factory=dict, repr=False)  # one Profile per loss head profiled

    @property
    def n_layer(self) -> int:
        return len(self.costs)

    def with_extra(self, extra: int) -> Profile:
        return replace(self, extra=extra)


# ----------------------------------------------------------------------------------------------------
# The peak model and the exact solver.
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Solution:
    treatments: tuple[str, ...]
    peak: int  # predicted whole-step peak, bytes
    step_ms: float  # predicted optimizer-step time
    where: str  # the phase that sets the peak

    def describe(self) -> str:
        return describe_treatments(self.treatments)


def mib(n: float) -> str:
    """Bytes as MiB with enough digits to tell small plans apart."""
    v = n / MIB
    return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"


def describe_treatments(treatments: Sequence[str]) -> str:
    runs: list[list[Any]] = []
    for i, t in enumerate(treatments):
        if runs and runs[-1][2] == t:
            runs[-1][1] = i
        else:
            runs.append([i, i, t])
    return " ".join(f"[{a}]:{t}" if a == b else f"[{a}-{b}]:{t}" for a, b, t in runs)


class PeakModel:
    """Predicted whole-step peak and step time of any per-block plan, from a Profile.

    Candidates (bytes), for treatments t_0..t_{L-1}, with kf/kb/fp/tr/rs a block's kept_fwd/kept/fwd_peak/
    transient/restored and g_j its gradients:
      forward, embedding      F + embed_fwd_peak
      forward, block i        F + gap_fwd - x + Σ_{j<i} kf_j + fp_i
      forward, head           F + head_fwd_peak - x + Σ_j kf_j
      backward, head          B + head_bwd_peak - x + Σ_j kb_j
      backward, block i       B + gap_bwd - 3x + Σ_{j≤i} kb_j + tr_i + rs_{i-1} (prefetch) + Σ_{j>i} g_j (accum 1)
      backward, embedding     B + embed_bwd_peak - x + Σ_j g_j (accum 1)
      optimizer step          opt_peak
    with F = params + optimizer + grads (last step's gradients live through the forward: Lightning zeroes them
    after `training_step`) and B = params + optimizer (+ every gradient when accumulating: later micro-batches run
    with them alive), each plus BOOKKEEPING. The segmented run holds x0 and the head input (and its gradient)
    itself; `- x` / `- 3x` take those out where the blocks count them.
    """

    def __init__(self, prof: Profile) -> None:
        self.prof = p = prof
        x = p.x_bytes
        base = p.params + p.optimizer + p.untracked + p.extra + BOOKKEEPING
        fwd = base + p.grads
        # Accumulating: later micro-batches run their backward with every gradient alive (the segmented run and
        # the blocks also count the gradients they create: with gradients present those are summed in place, so
        # this errs high by at most one block's gradients).
        bwd = base + (p.grads if p.accum > 1 else 0)
        self.c_embed_fwd = fwd + p.embed_fwd_peak
        self.c_fwd = fwd + p.gap_fwd - x
        self.c_head_fwd = fwd + p.head_fwd_peak - x
        self.c_head_bwd = bwd + p.head_bwd_peak - x
        self.c_bwd = bwd + p.gap_bwd - 3 * x
        self.c_embed_bwd = bwd + p.embed_bwd_peak - x + (sum(p.block_grads) if p.accum == 1 else 0)
        self.c_opt = p.opt_peak + p.untracked + p.extra + BOOKKEEPING
        L = p.n_layer
        self.after = [sum(p.block_grads[i + 1 :]) if p.accum == 1 else 0 for i in range(L)]
        self.constant = max(self.c_embed_fwd, self.c_embed_bwd, self.c_opt)
        self.fixed_ms = p.accum * p.rest_ms + p.opt_ms

    # -- evaluation (the definition; the solver must agree with it) ---------------------------------------------
    def candidates(self, treatments: Sequence[str]) -> list[tuple[int, str]]:
        p = self.prof
        if len(treatments) != p.n_layer:
            raise ValueError(f"{len(treatments)} treatments for {p.n_layer} blocks")
        out = [
            (self.c_embed_fwd, "forward, embedding"),
            (self.c_embed_bwd, "backward, embedding"),
            (self.c_opt, "optimizer step"),
        ]
        sf = sb = 0
        prev_restored = 0
        for i, t in enumerate(treatments):
            c = p.costs[i][t]
            out.append((self.c_fwd + sf + c.fwd_peak, f"forward, block {i}"))
            sf += c.kept_fwd
            sb += c.kept
            out.append((self.c_bwd + sb + c.transient + prev_restored + self.after[i], f"backward, block {i}"))
            prev_restored = c.restored if p.prefetch else 0
        out.append((self.c_head_fwd + sf, "forward, loss head"))
        out.append((self.c_head_bwd + sb, "backward, loss head"))
        return out

    def evaluate(self, treatments: Sequence[str]) -> Solution:
        peak, where = max(self.candidates(treatments), key=lambda c: c[0])
        return Solution(tuple(treatments), peak, self.step_ms(treatments), where)

    def step_ms(self, treatments: Sequence[str]) -> float:
        p = self.prof
        return self.fixed_ms + p.accum * sum(p.costs[i][t].ms for i, t in enumerate(treatments))

    # -- the exact solvers ---------------------------------------------------------------------------------------
    def solve(self, budget: int) -> Solution | None:
        """The plan of least predicted step time whose predicted peak is ≤ budget; None if none is.

        DP over blocks in order. State: (Σ kf, Σ kb, restored bytes of the previous block) of the blocks decided so
        far; every later constraint depends on the past only through these, so keeping the fastest partial plan per
        state is exact. Ties go to the earlier treatment in `treatments` order, block by block.
        """
        if self.constant > budget:
            return None
        best = self._dp(budget, objective="time")
        return None if best is None else self.evaluate(best)

    def min_peak(self) -> Solution:
        """The fastest plan of least predicted peak; exact: the least peak by the same DP on the running maximum,
        then the fastest plan within it."""
        best = self._dp(None, objective="peak")
        assert best is not None
        least = self.evaluate(best).peak
        fastest = self.solve(least)
        assert fastest is not None and fastest.peak == least
        return fastest

    def _dp(self, budget: int | None, objective: str) -> tuple[str, ...] | None:
        """Blocks in order; state (Σ kf, Σ kb, prefetched bytes) → (best score, back-pointer). Ties keep the first
        partial plan found (states and treatments are visited in a fixed order, so the answer is reproducible)."""
        p = self.prof
        prefetch = p.prefetch
        # score: time (objective=time) or (running max, time) (objective=peak)
        states: dict[tuple[int, int, int], tuple[Any, Any]] = {(0, 0, 0): (_zero(objective), None)}
        for i in range(p.n_layer):
            costs = [(t, p.costs[i][t]) for t in p.treatments]
            after = self.after[i]
            nxt: dict[tuple[int, int, int], tuple[Any, Any]] = {}
            for (sf, sb, prev), (score, path) in states.items():
                for t, c in costs:
                    fwd = self.c_fwd + sf + c.fwd_peak
                    nsb = sb + c.kept
                    bwd = self.c_bwd + nsb + c.transient + prev + after
                    if budget is not None and (fwd > budget or bwd > budget):
                        continue
                    key = (sf + c.kept_fwd, nsb, c.restored if prefetch else 0)
                    if objective == "time":
                        nscore: Any = score + c.ms
                    else:
                        nscore = (max(score[0], fwd, bwd), score[1] + c.ms)
                    old = nxt.get(key)
                    if old is None or nscore < old[0]:
                        nxt[key] = (nscore, (path, t))
            states = _pareto(nxt)
            if not states:
                return None
        best: tuple[Any, Any] | None = None
        for (sf, sb, _), (score, path) in states.items():
            head = max(self.c_head_fwd + sf, self.c_head_bwd + sb)
            if budget is not None and head > budget:
                continue
            if objective == "peak":
                score = (max(score[0], head, self.constant), score[1])
            if best is None or score < best[0]:
                best = (score, path)
        if best is None:
            return None
        out: list[str] = []
        path = best[1]
        while path is not None:
            path, t = path
            out.append(t)
        return tuple(reversed(out))

    def brute_force(self, budget: int) -> Solution | None:
        """Every plan, evaluated: the reference the tests hold `solve` to (|treatments|^L plans)."""
        best: Solution | None = None
        for combo in itertools.product(self.prof.treatments, repeat=self.prof.n_layer):
            s = self.evaluate(combo)
            if s.peak <= budget and (best is None or s.step_ms < best.step_ms):
                best = s
        return best


def _pareto(states: dict[tuple[int, int, int], tuple[Any, Any]]) -> dict[tuple[int, int, int], tuple[Any, Any]]:
    """Drop dominated partial plans: another keeps no more bytes in forward, to backward and in prefetch, and scores
    no worse. Every later constraint and cost is monotone in those, so nothing optimal is lost (exact)."""
    if len(states) < 64:
        return states
    order = sorted(states.items(), key=lambda kv: (kv[1][0], kv[0]))  # best score first
    kept: dict[tuple[int, int, int], tuple[Any, Any]] = {}
    # staircase per prefetch value: (sf, sb) pairs of kept states; a new state is dominated if some kept one (of no
    # larger prefetch and, by the order, no worse score) has sf' <= sf and sb' <= sb
    stairs: dict[int, list[tuple[int, int]]] = {}
    for key, value in order:
        sf, sb, prev = key
        dominated = False
        for pv, pts in stairs.items():
            if pv <= prev and any(a <= sf and b <= sb for a, b in pts):
                dominated = True
                break
        if dominated:
            continue
        kept[key] = value
        stairs.setdefault(prev, []).append((sf, sb))
    return kept


def _zero(objective: str) -> Any:
    return 0.0 if objective == "time" else (0, 0.0)


# ----------------------------------------------------------------------------------------------------
# Profiling.
# ----------------------------------------------------------------------------------------------------


class _OneLayer(DecoderAdapter):
    """Layer `i` of a model as a one-layer decoder, so `install_plan` puts a treatment on that layer alone."""

    def __init__(self, parent: DecoderAdapter, i: int) -> None:
        super().__init__(parent.model)
        self.parent, self.i = parent, i

    @property
    def layers(self) -> Any:
        return [self.parent.layers[self.i]]

    @property
    def attention(self) -> str:
        return self.parent.attention

    def wrap_core_attention(self, i: int, wrapper: Any) -> None:
        self.parent.wrap_core_attention(self.i, wrapper)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _storage_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


def _unique_bytes(tensors: Sequence[torch.Tensor | None]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
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


# Fake tensors (the estimator's planner) have no clock: a run's "milliseconds" are its FLOPs at this rate, which ranks
# plans by the compute they spend (recompute included), not by what a device would take.
FAKE_FLOPS_PER_MS = 1e9  # 1 TFLOP/s: a "millisecond" is a GFLOP


@dataclass
class _FlopClock:
    """The planner's clock on fake tensors: FLOPs (torch's formulas) at FAKE_FLOPS_PER_MS."""

    def __call__(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        from trainer.flops import FlopTally

        with FlopTally() as tally:
            out = fn()
        return out, tally.total / FAKE_FLOPS_PER_MS


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _run_block(
    layer: nn.Module,
    x_src: torch.Tensor,
    context: tuple[tuple[Any, ...], dict[str, Any]],
    w: torch.Tensor,
    forward_context: Callable[[], Any],
    tracker: LiveTensorTracker | None,
    timer: _Timer,
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
        with forward_context():
            y = layer(x, *args, **kwargs)
            if tracker:
                out["end_fwd"] = tracker.live_bytes
        return y

    y, out["fwd_ms"] = timer(forward)
    if tracker:
        out["fwd_peak"] = max([start] + [p.live_bytes for p in tracker.timeline[n0:]])
        out["after_exit"] = tracker.live_bytes
        out["y"] = _storage_bytes(y)
    seed = (y * w).sum()
    n1 = len(tracker.timeline) if tracker else 0
    level = tracker.live_bytes if tracker else 0
    _, out["bwd_ms"] = timer(seed.backward)
    if tracker:
        out["bwd_peak"] = max([level] + [p.live_bytes for p in tracker.timeline[n1:]])
    return out


FAKE_MS_NOTE = "fake tensors: each 'ms' is a GFLOP (FLOPs at 1 TFLOP/s), a ranking by compute, not a time"


def profile(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    loss_fn: Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor] | Mapping[str, Callable[..., torch.Tensor]],
    precision: str,
    make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
    param_groups: list[dict[str, Any]] | None = None,
    accum: int = 1,
    treatments: Sequence[str] = ("none", "selective", "op_sac", "full"),
    policy_cfg: Any = None,
    repeats: int = 3,
    grad_clip: float = 0.0,
    timing: bool = True,
    resident: Sequence[torch.Tensor] = (),
) -> Profile:
    """Measure what the planner needs on one micro-batch (see the module docstring).

    `model` meets the decoder contract (models/adapter.py); its installed policy is removed (the caller installs
    the plan). `loss_fn(batch)` is the training forward (the module's `loss_of`), or {loss name: loss_fn}: the
    embedding and head are then profiled under each and the Profile's `heads` holds one Profile per name (the
    first is this one). `make_optimizer(groups)` builds an optimizer of the run's kind; it is given lr=0 groups
    over the real parameters and stepped on zero gradients, which leaves every parameter bit-for-bit as it was. The
    caller restores RNG state if it matters (dropout draws from it). `resident`: training-state tensors already on
    the device that the profile measures anyway (a resumed run's optimizer state), so that they are not also
    counted as memory the tracker cannot see (CUDA).
    """
    if policy_cfg is None:
        policy_cfg = build_policy({"name": "per_block", "pattern": ["none"]}).cfg
    losses = dict(loss_fn) if isinstance(loss_fn, Mapping) else {"": loss_fn}
    idx, tgt = batch
    device = idx.device
    device_type = device.type
    forward_context = precision_.plugin(precision, device_type).forward_context
    fake = _is_fake(idx)
    timer: Any = _FlopClock() if fake else _Timer(device)
    adapter = adapter_for(model)
    params = list(model.parameters())
    saved_grads = [p.grad for p in params]
    was_training = model.training
    remove_policy(model)
    model.train()
    try:
        for p in params:
            p.grad = None
        first = next(iter(losses.values()))
        costs, block_grads, x_bytes = _profile_blocks(
            adapter, (idx, tgt), first, forward_context, timer, treatments, policy_cfg, repeats, device_type, timing
        )
        rests = {
            name: _profile_rest(adapter, (idx, tgt), fn, forward_context, timer, repeats, device_type, timing)
            for name, fn in losses.items()
        }
        opt = _profile_optimizer(model, make_optimizer, param_groups, grad_clip, timer, repeats, device_type, timing)
    finally:
        for p, g in zip(params, saved_grads, strict=True):
            p.grad = g
        for i in range(adapter.n_layer):
            adapter.override_forward(i, None)
        model.train(was_training)
    untracked = 0
    if device_type == "cuda" and not fake:
        state = [*model.parameters(), *model.buffers(), *resident]
        untracked = max(0, torch.cuda.memory_allocated(device) - _unique_bytes(state))
    profiles = {
        name: Profile(
            treatments=tuple(treatments),
            costs=costs,
            block_grads=block_grads,
            params=opt["params"],
            grads=opt["grads"],
            optimizer=opt["optimizer"],
            x_bytes=x_bytes,
            embed_fwd_peak=rest["embed_fwd_peak"],
            gap_fwd=rest["gap_fwd"],
            head_fwd_peak=rest["head_fwd_peak"],
            head_bwd_peak=rest["head_bwd_peak"],
            gap_bwd=rest["gap_bwd"],
            embed_bwd_peak=rest["embed_bwd_peak"],
            opt_peak=opt["peak"],
            micro_batch=idx.shape[0],
            seq_len=idx.shape[1],
            accum=accum,
            precision=precision,
            device=device_type,
            prefetch=bool(getattr(policy_cfg, "prefetch", True)),
            untracked=untracked,
            rest_ms=rest["ms"],
            opt_ms=opt["ms"],
            loss=name,
            notes=[FAKE_MS_NOTE] if fake else [],
        )
        for name, rest in rests.items()
    }
    primary = next(iter(profiles.values()))
    primary.heads = profiles
    return primary


def _block_inputs(
    adapter: DecoderAdapter, batch: tuple[torch.Tensor, torch.Tensor], loss_fn: Callable[..., Any],
    forward_context: Callable[[], Any], firsts: set[int],
) -> tuple[dict[int, torch.Tensor], list[tuple[tuple[Any, ...], dict[str, Any]]]]:  # fmt: skip
    """One no-grad pass over the micro-batch: the real input of the layers in `firsts`, and every layer's
    arguments (its context), as the model's own loop passes them."""
    inputs: dict[int, torch.Tensor] = {}
    contexts: list[tuple[tuple[Any, ...], dict[str, Any]]] = [((), {}) for _ in range(adapter.n_layer)]

    def record(i: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if i in firsts:
            inputs[i] = args[0].detach()
        contexts[i] = (tuple(args[1:]), dict(kwargs))

    hooks = [
        layer.register_forward_pre_hook(functools.partial(record, i), with_kwargs=True)
        for i, layer in enumerate(adapter.layers)
    ]
    try:
        with torch.no_grad(), forward_context():
            loss_fn(batch)
    finally:
        for h in hooks:
            h.remove()
    return inputs, contexts


def _profile_blocks(
    adapter: DecoderAdapter,
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable[..., Any],
    forward_context: Callable[[], Any],
    timer: _Timer,
    treatments: Sequence[str],
    policy_cfg: Any,
    repeats: int,
    device_type: str,
    timing: bool,
) -> tuple[list[dict[str, Cost]], list[int], int]:
    blocks = list(adapter.layers)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, b in enumerate(blocks):
        groups.setdefault(_block_signature(b), []).append(i)
    # The real input of each group's first block, from one no-grad pass over the micro-batch. A group's other
    # blocks are timed on that same input (their bytes and times do not depend on the values).
    firsts = {members[0] for members in groups.values()}
    inputs, contexts = _block_inputs(adapter, batch, loss_fn, forward_context, firsts)
    x_bytes = _storage_bytes(inputs[0])
    # offload's prefetch brings back what `none` would keep: measure `none`'s bytes even when it is no candidate
    measured = tuple(treatments) + (("none",) if "offload" in treatments and "none" not in treatments else ())
    chooser = build_policy({**_shared_params(policy_cfg), "name": "per_block", "pattern": ["none"]})
    seed_w = torch.randn_like(inputs[0], dtype=torch.float32)  # the backward seed's weights: (y * w).sum()
    memory: dict[tuple[int, str], dict[str, float]] = {}
    times: dict[tuple[int, str], tuple[float, float]] = {}

    def install(i: int, t: str) -> _OneLayer:
        one = _OneLayer(adapter, i)
        install_plan(one, Plan.per_block([t]), chooser)
        return one

    def uninstall(i: int) -> None:
        adapter.override_forward(i, None)
        adapter.wrap_core_attention(i, None)

    for members in groups.values():
        first = members[0]
        for t in measured:
            install(first, t)
            try:
                # warm-up (lazy init, SAC contexts, allocator), then the tracked run with fresh gradients
                _run_block(blocks[first], inputs[first], contexts[first], seed_w, forward_context, None, timer)
                for p in blocks[first].parameters():
                    p.grad = None
                tracker = LiveTensorTracker(record_timeline=True, device=device_type)
                with tracker:
                    m = _run_block(blocks[first], inputs[first], contexts[first], seed_w, forward_context, tracker,
                                   timer)  # fmt: skip
                memory[(first, t)] = m
                fwd_ms: list[float] = []
                bwd_ms: list[float] = []
                if timing and t in treatments:
                    for r in range(repeats):
                        i = members[r % len(members)]
                        if i != first:
                            install(i, t)
                        try:
                            tm = _run_block(blocks[i], inputs[first], contexts[i], seed_w, forward_context, None, timer)
                        finally:
                            if i != first:
                                uninstall(i)
                        fwd_ms.append(tm["fwd_ms"])
                        bwd_ms.append(tm["bwd_ms"])
                times[(first, t)] = (
                    statistics.median(fwd_ms) if fwd_ms else 0.0,
                    statistics.median(bwd_ms) if bwd_ms else 0.0,
                )
            finally:
                uninstall(first)
                for i in members:
                    for p in blocks[i].parameters():
                        p.grad = None
    costs: list[dict[str, Cost]] = [{} for _ in blocks]
    for members in groups.values():
        first = members[0]
        for t in treatments:
            m = memory[(first, t)]
            y = int(m["y"])
            kept_fwd = int(m["end_fwd"]) - y
            kept = int(m["after_exit"]) - y
            restored = 0
            if t == "offload":  # what comes back: the bytes `none` keeps less those left on the device
                restored = max(0, int(memory[(first, "none")]["after_exit"]) - int(m["after_exit"]))
            cost = Cost(
                kept_fwd=kept_fwd,
                kept=kept,
                fwd_peak=int(m["fwd_peak"]),
                transient=int(m["bwd_peak"]) - y - kept,
                restored=restored,
                fwd_ms=times[(first, t)][0],
                bwd_ms=times[(first, t)][1],
            )
            for i in members:
                costs[i][t] = cost
    block_grads = [_unique_bytes([p for p in b.parameters() if p.requires_grad]) for b in blocks]
    return costs, block_grads, x_bytes


def _shared_params(policy_cfg: Any) -> dict[str, Any]:
    """The treatment parameters (save_ops, min_bytes, prefetch, ...) of a policy config, for the profile's own."""
    keys = ("save_ops", "min_bytes", "prefetch")
    values = {k: getattr(policy_cfg, k) for k in keys if getattr(policy_cfg, k, None) is not None}
    return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in values.items()}


def _profile_rest(
    adapter: DecoderAdapter,
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable[..., torch.Tensor],
    forward_context: Callable[[], Any],
    timer: _Timer,
    repeats: int,
    device_type: str,
    timing: bool,
) -> dict[str, Any]:
    """The model with its layers cut out: embedding → (cut) → loss head, forward then backward.

    At the cut (the first layer's call) the embedding's output x0 is kept and a fresh leaf h stands in for the last
    layer's output; the other layers pass it through. The head's backward stops at h, and x0.backward(h.grad) runs
    the embedding's. Live bytes are read at each phase.
    """
    model = adapter.model

    def run(tracker: LiveTensorTracker | None) -> dict[str, Any]:
        marks: dict[str, Any] = {}
        held: dict[str, torch.Tensor] = {}

        def cut(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            held["x0"] = x
            if tracker:
                marks["gap_fwd"] = tracker.live_bytes
                marks["n_cut"] = len(tracker.timeline)
            h = x.detach().clone().requires_grad_(True)
            held["h"] = h
            return h

        def through(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return x

        for i in range(adapter.n_layer):
            adapter.override_forward(i, cut if i == 0 else through)
        try:

            def forward() -> torch.Tensor:
                with forward_context():
                    return loss_fn(batch)

            loss, fwd_ms = timer(forward)
        finally:
            for i in range(adapter.n_layer):
                adapter.override_forward(i, None)
        if tracker:
            marks["embed_fwd_peak"] = max(p.live_bytes for p in tracker.timeline[: marks["n_cut"]])
            marks["head_fwd_peak"] = max(p.live_bytes for p in tracker.timeline[marks["n_cut"] :])
            n1 = len(tracker.timeline)
            level = tracker.live_bytes
        _, head_ms = timer(loss.backward)
        del loss
        if tracker:
            marks["head_bwd_peak"] = max([level] + [p.live_bytes for p in tracker.timeline[n1:]])
            marks["gap_bwd"] = tracker.live_bytes
        h = held.pop("h")
        g = h.grad
        h.grad = None
        del h
        x0 = held.pop("x0")
        if tracker:
            n2 = len(tracker.timeline)
            level = tracker.live_bytes
        _, embed_ms = timer(lambda: x0.backward(g))
        if tracker:
            marks["embed_bwd_peak"] = max([level] + [p.live_bytes for p in tracker.timeline[n2:]])
        marks["ms"] = fwd_ms + head_ms + embed_ms
        return marks

    params = list(model.parameters())
    run(None)  # warm-up
    for p in params:
        p.grad = None
    tracker = LiveTensorTracker(record_timeline=True, device=device_type)
    with tracker:
        out = run(tracker)
    ms = []
    if timing:
        for _ in range(repeats):
            for p in params:
                p.grad = None
            ms.append(run(None)["ms"])
    for p in params:
        p.grad = None
    out["ms"] = statistics.median(ms) if ms else 0.0
    return out


def _profile_optimizer(
    model: nn.Module,
    make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
    param_groups: list[dict[str, Any]] | None,
    grad_clip: float,
    timer: _Timer,
    repeats: int,
    device_type: str,
    timing: bool,
) -> dict[str, Any]:
    """Training-state bytes and the peak of clipping + one optimizer step, on the real parameters at lr=0."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = param_groups or [{"params": params}]
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"]), "lr": 0.0} for g in groups]
    opt = make_optimizer(groups)
    for p in params:
        p.grad = torch.zeros_like(p)

    def step() -> None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])  # the numeric guard's
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        del norm

    step()  # creates the optimizer state
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    train_state = [*model.parameters(), *model.buffers()]
    grads = [p.grad for p in params]
    out: dict[str, Any] = {
        "params": _unique_bytes(train_state),
        "grads": _unique_bytes(grads),
        "optimizer": _unique_bytes(state),
    }
    tracker = LiveTensorTracker(device=device_type)
    with tracker:
        tracker.adopt([*train_state, *grads, *state])
        step()
    out["peak"] = tracker.peak_bytes
    ms = []
    if timing:
        for _ in range(repeats):
            ms.append(timer(step)[1])
    out["ms"] = statistics.median(ms) if ms else 0.0
    for p in params:
        p.grad = None
    return out


# ----------------------------------------------------------------------------------------------------
# Budgets, the plan, the explanation, the refusal.
# ----------------------------------------------------------------------------------------------------


def budget_bytes(cfg: Any, device: torch.device | str) -> tuple[int, str]:
    """The configured budget in bytes and how it was given; a one-line PolicyError when it cannot be resolved."""
    given = cfg.budgets_given  # AutoConfig's
    if len(given) != 1:
        raise PolicyError(
            "policy auto: give exactly one budget: policy.budget_mib=…, policy.budget_gb=… or "
            f"policy.budget_fraction=… (got {', '.join(given) or 'none'})"
        )
    key = given[0]
    value = getattr(cfg, key)
    if key == "budget_mib":
        return int(value * MIB), f"policy.budget_mib={value:g}"
    if key == "budget_gb":
        return int(value * 1e9), f"policy.budget_gb={value:g}"
    device = torch.device(device)
    if device.type != "cuda":
        raise PolicyError(
            f"policy auto: policy.budget_fraction={value:g} is a fraction of a CUDA device's memory and this run is "
            f"on {device.type}; give policy.budget_mib=… instead"
        )
    total = torch.cuda.get_device_properties(device).total_memory
    return int(value * total), f"policy.budget_fraction={value:g} of {total / MIB:,.0f} MiB"


def candidate_treatments(cfg: Any, attention: str, device_type: str) -> tuple[tuple[str, ...], list[str]]:
    """The configured candidates that differ on this model and device, and a note for each one dropped (each
    treatment says itself when it would change nothing: `Policy.unavailable`)."""
    notes = []
    out = []
    for t in dict.fromkeys(cfg.treatment_candidates):
        why = POLICIES[t](POLICIES[t].Config()).unavailable(attention, device_type)
        if why:
            notes.append(f"{t} left out: {why}")
            continue
        out.append(t)
    if not out:
        raise PolicyError(
            f"policy auto: no candidate treatment applies here (policy.candidates={list(cfg.treatment_candidates)}); "
            "include none, op_sac or full"
        )
    return tuple(out), notes


@dataclass
class PlanResult:
    """The chosen plan, its prediction, and what it was chosen from."""

    profile: Profile
    budget: int
    budget_text: str
    solution: Solution
    uniform: dict[str, Solution]
    micro_batch: int
    accum: int
    configured_micro_batch: int
    configured_accum: int
    notes: list[str] = field(default_factory=list)
    fits: bool = True

    @property
    def treatments(self) -> tuple[str, ...]:
        return self.solution.treatments

    @property
    def loss(self) -> str:
        """The loss head the plan was solved with (the configured one unless only another fits)."""
        return self.profile.loss

    @property
    def plan(self) -> Plan:
        return Plan.per_block(self.treatments)

    # -- explanation ---------------------------------------------------------------------------------------------
    def table_rows(self) -> list[dict[str, Any]]:
        p = self.profile
        rows = []
        for i, t in enumerate(self.treatments):
            c = p.costs[i][t]
            rows.append(
                {
                    "block": i,
                    "treatment": t,
                    "kept_mib": c.kept / MIB,
                    "kept_in_forward_mib": c.kept_fwd / MIB,
                    "transient_mib": c.transient / MIB,
                    "fwd_ms": c.fwd_ms,
                    "bwd_ms": c.bwd_ms,
                }
            )
        return rows

    def fixed_mib(self) -> dict[str, float]:
        p = self.profile
        return {
            "params_and_buffers": p.params / MIB,
            "grads": p.grads / MIB,
            "optimizer_state": p.optimizer / MIB,
            "untracked": p.untracked / MIB,
            "replan_excess": p.extra / MIB,
        }

    def text(self) -> str:
        """Console / train.log / TensorBoard (markdown-friendly) explanation."""
        s, p = self.solution, self.profile
        head = (
            f"policy=auto: budget {mib(self.budget)} MiB ({self.budget_text}); micro-batch "
            f"{self.micro_batch}×{p.seq_len}, accum {self.accum}, {p.precision}, {p.device}"
            + (f", loss={p.loss}" if p.loss else "")
        )
        if (self.micro_batch, self.accum) != (self.configured_micro_batch, self.configured_accum):
            head += (
                f" (allow_accum: was {self.configured_micro_batch}×{p.seq_len}, accum {self.configured_accum}; "
                "same tokens per step)"
            )
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines = [
            head,
            f"plan {s.describe()}: predicted peak {mib(s.peak)} MiB ({verdict}; set by {s.where}), "
            f"step {s.step_ms:,.0f} ms",
            "fixed: " + ", ".join(f"{k.replace('_', ' ')} {v:,.1f} MiB" for k, v in self.fixed_mib().items() if v > 0),
            "",
            "| block | treatment | kept to backward MiB | kept in forward MiB | transient MiB | fwd ms | bwd ms |",
            "|---:|---|---:|---:|---:|---:|---:|",
        ]
        runs: list[tuple[int, int, dict[str, Any]]] = []  # consecutive blocks with identical rows share one line
        for r in self.table_rows():
            same = runs and {k: v for k, v in runs[-1][2].items() if k != "block"} == {
                k: v for k, v in r.items() if k != "block"
            }
            if same:
                runs[-1] = (runs[-1][0], r["block"], runs[-1][2])
            else:
                runs.append((r["block"], r["block"], r))
        for a, b, r in runs:
            lines.append(
                f"| {a if a == b else f'{a}-{b}'} | {r['treatment']} | {r['kept_mib']:.3f} | "
                f"{r['kept_in_forward_mib']:.3f} | {r['transient_mib']:.3f} | {r['fwd_ms']:.1f} | {r['bwd_ms']:.1f} |"
            )
        lines += ["", "uniform policies, predicted from the same profile:", ""]
        lines += ["| policy | predicted peak MiB | fits | step ms | × plan |", "|---|---:|---|---:|---:|"]
        for name, u in self.uniform.items():
            lines.append(
                f"| {name} | {mib(u.peak)} | {'yes' if u.peak <= self.budget else 'no'} | "
                f"{u.step_ms:,.0f} | {u.step_ms / s.step_ms:.2f} |"
            )
        lines += [f"note: {n}" for n in self.notes + p.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        s = self.solution
        return {
            "budget_mib": round(self.budget / MIB, 4),
            "budget": self.budget_text,
            "plan": list(self.treatments),
            "plan_describe": s.describe(),
            "loss": self.loss,
            "predicted_peak_mib": s.peak / MIB,
            "predicted_step_ms": s.step_ms,
            "peak_set_by": s.where,
            "fits": self.fits,
            "micro_batch": self.micro_batch,
            "accum": self.accum,
            "blocks": self.table_rows(),
            "fixed_mib": self.fixed_mib(),
            "runner_up": {
                name: {
                    "predicted_peak_mib": u.peak / MIB,
                    "predicted_step_ms": u.step_ms,
                    "fits": u.peak <= self.budget,
                }
                for name, u in self.uniform.items()
            },
            "candidates": list(self.profile.treatments),
            "notes": self.notes + self.profile.notes,
        }


def solve_profile(
    prof: Profile,
    budget: int,
    budget_text: str,
    configured: tuple[int, int],
    notes: Sequence[str] = (),
) -> PlanResult | None:
    model = PeakModel(prof)
    sol = model.solve(budget)
    if sol is None:
        return None
    uniform = {t: model.evaluate([t] * prof.n_layer) for t in prof.treatments}
    return PlanResult(
        profile=prof,
        budget=budget,
        budget_text=budget_text,
        solution=sol,
        uniform=uniform,
        micro_batch=prof.micro_batch,
        accum=prof.accum,
        configured_micro_batch=configured[0],
        configured_accum=configured[1],
        notes=list(notes),
    )


def frugal_result(prof: Profile, budget: int, budget_text: str, configured: tuple[int, int]) -> PlanResult:
    """The least-peak plan, marked as not fitting (what a re-plan falls back to)."""
    model = PeakModel(prof)
    sol = model.min_peak()
    uniform = {t: model.evaluate([t] * prof.n_layer) for t in prof.treatments}
    return PlanResult(prof, budget, budget_text, sol, uniform, prof.micro_batch, prof.accum, *configured, fits=False)


def affine_profile(big: Profile, small: Profile, micro_batch: int) -> Profile:
    """Every byte figure at another micro-batch size, from two measured sizes (each tensor is ∝ batch or fixed)."""
    b1, b2 = big.micro_batch, small.micro_batch

    def at(v1: int, v2: int) -> int:
        return max(0, round(v1 + (v1 - v2) * (micro_batch - b1) / (b1 - b2)))

    costs = [
        {
            t: Cost(
                kept_fwd=at(c1.kept_fwd, c2.kept_fwd),
                kept=at(c1.kept, c2.kept),
                fwd_peak=at(c1.fwd_peak, c2.fwd_peak),
                transient=at(c1.transient, c2.transient),
                restored=at(c1.restored, c2.restored),
            )
            for t, c1 in d1.items()
            for c2 in [d2[t]]
        }
        for d1, d2 in zip(big.costs, small.costs, strict=True)
    ]
    fields_ = ("x_bytes", "embed_fwd_peak", "gap_fwd", "head_fwd_peak", "head_bwd_peak", "gap_bwd", "embed_bwd_peak")
    return replace(
        big,
        costs=costs,
        micro_batch=micro_batch,
        opt_peak=big.opt_peak,
        **{f: at(getattr(big, f), getattr(small, f)) for f in fields_},
    )


def refusal(
    prof: Profile,
    budget: int,
    budget_text: str,
    small: Profile | None,
    tried: Sequence[int] = (),
) -> str:
    """One line: the budget is too small; the smallest budget that fits; the largest micro-batch that fits it."""
    frugal = PeakModel(prof).min_peak()
    need = smallest_budget_mib(frugal.peak)
    line = (
        f"policy auto: no plan fits {budget_text} ({mib(budget)} MiB): the most frugal plan "
        f"({frugal.describe()}) needs {need:g} MiB at micro-batch {prof.micro_batch}; "
        f"give policy.budget_mib={need:g} or more"
    )
    b = largest_micro_batch(prof, small, budget)
    if tried:
        line += f" (allow_accum tried micro-batches {', '.join(map(str, tried))})"
    if b is None:
        line += ", or a smaller model or seq_len (not even micro-batch 1 fits)"
    else:
        assert small is not None
        line += (
            f", or batch_size={b} (fits with {PeakModel(affine_profile(prof, small, b)).min_peak().describe()}; "
            "raise accum to keep the tokens per step" + ("" if tried else ", or set policy.allow_accum=true") + ")"
        )
    return line


def smallest_budget_mib(peak: int) -> float:
    """A budget in MiB, rounded up (3 decimals below 10 MiB, 1 above), that a plan of this peak fits."""
    digits = 3 if peak < 10 * MIB else 1
    return math.ceil(peak / MIB * 10**digits) / 10**digits


def largest_micro_batch(prof: Profile, small: Profile | None, budget: int) -> int | None:
    if small is None or small.micro_batch == prof.micro_batch:
        return None
    for b in range(prof.micro_batch - 1, 0, -1):
        if PeakModel(affine_profile(prof, small, b)).min_peak().peak <= budget:
            return b
    return None


# ----------------------------------------------------------------------------------------------------
# The entry points: a model in a run (the callback) and a config (the estimator).
# ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Profiling draws dropout masks; training must draw the same ones as without it."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


def plan_model(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    cfg: Any,
    *,
    loss_fns: Mapping[str, Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]],
    precision: str,
    accum: int,
    make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
    param_groups: list[dict[str, Any]] | None = None,
    grad_clip: float = 0.0,
    resident: Sequence[torch.Tensor] = (),
) -> PlanResult:
    """Profile `model` on `batch`, solve for `cfg`'s budget and return the plan; a one-line PolicyError otherwise.

    `loss_fns`: {loss head: the training forward under it}, the configured head first. The plan keeps the
    configured head when any plan fits with it; otherwise it takes the fastest plan with another head that fits
    (a chunked head frees the logits: "when the budget needs it").
    With cfg.allow_accum, when nothing fits, the micro-batch is halved (accumulation doubled, same tokens per
    step) and profiled again, as long as it halves evenly. The RNG is left as it was found.
    """
    idx, tgt = batch
    device = idx.device
    budget, budget_text = budget_bytes(cfg, device)
    treatments, notes = candidate_treatments(cfg, adapter_for(model).attention, device.type)
    configured = (idx.shape[0], accum)

    def run(b: int, acc: int, timing: bool = True) -> Profile:
        with preserved_rng(device):
            return profile(
                model,
                (idx[:b], tgt[:b]),
                loss_fn=loss_fns,
                precision=precision,
                make_optimizer=make_optimizer,
                param_groups=param_groups,
                accum=acc,
                treatments=treatments,
                policy_cfg=cfg,
                repeats=cfg.profile_repeats,
                grad_clip=grad_clip,
                timing=timing,
                resident=resident,
            )

    def solve(prof: Profile) -> PlanResult | None:
        heads = list(prof.heads.values()) or [prof]
        first = solve_profile(heads[0], budget, budget_text, configured, notes)
        if first is not None:
            return first
        others = [r for h in heads[1:] if (r := solve_profile(h, budget, budget_text, configured, notes))]
        if not others:
            return None
        best = min(others, key=lambda r: r.solution.step_ms)
        best.notes.append(f"loss head {best.loss}: no plan fits with the configured {heads[0].loss}")
        return best

    def frugal_head(prof: Profile) -> Profile:
        heads = list(prof.heads.values()) or [prof]
        return min(heads, key=lambda h: PeakModel(h).min_peak().peak)

    b, acc = idx.shape[0], accum
    prof = run(b, acc)
    result = solve(prof)
    if result is not None:
        return result
    first, small = prof, None
    tried = []
    while cfg.allow_accum and b % 2 == 0:
        b, acc = b // 2, acc * 2
        prof = run(b, acc)
        tried.append(b)
        small = small or prof
        result = solve(prof)
        if result is not None:
            return result
    if small is None and first.micro_batch > 1:
        small = run(first.micro_batch // 2, accum, timing=False)  # bytes at a second size: the affine fit
    head = frugal_head(first)
    small_head = None if small is None else (small.heads.get(head.loss) or small)
    raise PolicyError(refusal(head, budget, budget_text, small_head, tried))


def default_optimizer(weight_decay: float = 0.1) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer]:
    return lambda groups: torch.optim.AdamW(groups, lr=0.0, weight_decay=weight_decay)


def head_candidates(module: Any, cfg: Any) -> dict[str, Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]]:
    """{loss head: the module's training forward under it}: the module's configured head first, then each of
    `cfg.loss_candidates` (auto's) with the same chunk size."""
    from trainer.loss import LossConfig

    configured = module.loss_config
    names = [configured.name] + [n for n in (cfg.loss_candidates or []) if n != configured.name]
    out = {}
    for name in names:
        loss_cfg = LossConfig(name=name, chunk_tokens=configured.chunk_tokens, ignore_index=configured.ignore_index)
        out[name] = functools.partial(module.loss_of, loss=loss_cfg)
    return out


def plan_result_for_config(config: Any, device: torch.device | str | None = None, fake: bool = False) -> PlanResult:
    """`plan_model` on the configured model (seeded init, as a run builds it) and a random micro-batch of the
    configured shape (precision `auto` settled as a run settles it). `fake`: on fake tensors (trainer.estimate's
    session), so a model of any size is planned without its memory: bytes are as measured, times are FLOPs."""
    from trainer import build
    from trainer.module import param_groups

    policy = build_policy(config.policy)
    if policy.cfg.name != "auto":
        raise PolicyError(f"plan_for_config: policy={policy.cfg.name} has no planner; use policy=auto")
    if fake:
        from trainer.session import open_session

        session = open_session(config, None if device is None else torch.device(device).type)
        with contextlib.closing(session), session.active():
            module = session.module
            for p in module.parameters():  # the profile measures its own state from none
                p.grad = None
            policy.check(module.adapter.n_layer, module.adapter.attention)
            return plan_model(
                module.model,
                session.batches[0],
                policy.cfg,
                loss_fns=head_candidates(module, policy.cfg),
                precision=session.precision,
                accum=config.accum,
                make_optimizer=default_optimizer(config.optim.weight_decay),
                param_groups=param_groups(module.model, config.optim.weight_decay),
                grad_clip=config.trainer.grad_clip,
            )
    device = torch.device(device if device is not None else build.train_device(config))
    chosen, _ = precision_.resolve(config.precision, device.type)
    hf_config = build.hf_config(config)
    cpu = torch.get_rng_state()
    try:
        torch.manual_seed(config.seed)
        module = build.module(config, "none", hf_config=hf_config)
        module = precision_.plugin(chosen, device.type).convert_module(module).to(device)
        vocab = module.adapter.head.weight.shape[0]
        g = torch.Generator().manual_seed(config.seed)
        shape = (config.batch_size, config.seq_len)
        idx = torch.randint(0, vocab, shape, generator=g).to(device)
        tgt = torch.randint(0, vocab, shape, generator=g).to(device)
    finally:
        torch.set_rng_state(cpu)
    policy.check(module.adapter.n_layer, module.adapter.attention)
    return plan_model(
        module.model,
        (idx, tgt),
        policy.cfg,
        loss_fns=head_candidates(module, policy.cfg),
        precision=chosen,
        accum=config.accum,
        make_optimizer=default_optimizer(config.optim.weight_decay),
        param_groups=param_groups(module.model, config.optim.weight_decay),
        grad_clip=config.trainer.grad_clip,
    )


def plan_for_config(config: Any, device: torch.device | str | None = None, fake: bool = False) -> tuple[Plan, str, str]:
    """What `python -m trainer.estimate policy=auto policy.budget_mib=…` prints: the plan, its loss head and its
    explanation.

    Builds the configured model and a random micro-batch of the configured shape (on CUDA when the config would
    train there, else CPU), profiles and solves exactly as training does at fit start (same function), so both
    arrive at the same plan up to timing noise between near-equal plans. Raises the one-line PolicyError when
    nothing fits.
    """
    result = plan_result_for_config(config, device, fake)
    return result.plan, result.loss, result.text()


__all__ = [
    "Cost",
    "PeakModel",
    "PlanResult",
    "Profile",
    "Solution",
    "budget_bytes",
    "plan_for_config",
    "plan_model",
    "plan_result_for_config",
    "profile",
]
