"""A policy in your own training loop: no train.py, no Hydra, no LightningModule of ours.

    from trainer.loop import apply_policy, check_policy, estimate_policy, remove_policy

    apply_policy(model, "full")                                    # your nn.Module (the decoder contract) or HF model
    apply_policy(model, {"name": "per_block", "blocks": ["full", "none", "op_sac", "none"]})   # a plan, per block
    remove_policy(model)                                           # the plain model again (state_dict keys never move)
    result = check_policy(model, "op_sac", batches, loss_fn)       # its steps against none's, compared
    est = estimate_policy(make_model, "full", batch, loss_fn)      # one step's bytes on fake tensors

`loss_fn(model, batch) -> loss` is your forward; the optimizer is yours (`make_optimizer(params)`, AdamW by
default). The step these functions run is a plain PyTorch loop's: `zero_grad(set_to_none=True)`, forward,
backward, `optimizer.step()`. A policy is installed by forward override through the decoder contract, so the model
stays the object you hold: the Hugging Face `Trainer`, a Lightning `Trainer` or your own loop train it as before.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainer.check import CheckResult, compare_step
from trainer.core.step import StepMeter
from trainer.policies import Policy, apply_policy, build_policy, remove_policy

Batch = Any
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
MakeOptimizer = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
PolicySpec = Policy | Mapping[str, Any] | str


def default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def loop_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, loss_fn: LossFn, meter: StepMeter | None = None
) -> torch.Tensor:
    """One step of a plain PyTorch loop; `meter` takes its memory figures (the training state adopted first)."""
    if meter is not None:
        meter.begin(model, [optimizer])
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    if meter is not None:
        meter.close_window(model)
    optimizer.step()
    return loss.detach()


def check_policy(
    model: nn.Module,
    policy: PolicySpec,
    batches: Sequence[Batch],
    loss_fn: LossFn,
    make_optimizer: MakeOptimizer = default_optimizer,
    tolerance: float = 0.0,
    seed: int = 0,
) -> CheckResult:
    """`len(batches)` steps of two copies of `model` from its current weights, one under `none` and one under
    `policy`, with the RNG reset to the same state before each step (dropout draws the same masks), compared after
    each backward: every gradient and the loss, bitwise by default (`tolerance`: relative). `model` is unchanged."""
    ref, mod = copy.deepcopy(model), copy.deepcopy(model)
    remove_policy(ref)
    installed = apply_policy(mod, policy)
    out = CheckResult(installed.cfg.name, mod.activation_plan.describe(), len(batches), tolerance, tolerance == 0.0)
    names = [n for n, p in mod.named_parameters() if p.requires_grad]
    optimizers = {id(m): make_optimizer([p for p in m.parameters() if p.requires_grad]) for m in (ref, mod)}
    for s, batch in enumerate(batches):
        grads: dict[int, list[torch.Tensor]] = {}
        losses = []
        for k, m in enumerate((ref, mod)):
            m.train()
            torch.manual_seed(seed + s)
            if torch.cuda.is_available():
                torch.cuda.manual_seed_all(seed + s)
            opt = optimizers[id(m)]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(m, batch)
            loss.backward()
            grads[k] = [
                torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                for p in m.parameters()
                if p.requires_grad
            ]
            opt.step()
            losses.append(float(loss.detach()))
        compare_step(out, s, names, grads, (losses[0], losses[1]), tolerance)
    return out


@dataclass
class LoopEstimate:
    """One steady step of your loop under a policy: what a run of it holds, in bytes."""

    policy: str
    plan: str
    activation_bytes: int  # live tensors over the forward and backward above the training state, gradients excluded
    peak_bytes: int  # the step's whole peak: parameters, gradients, optimizer state and activations
    device: str
    notes: list[str] = field(default_factory=list)


def estimate_policy(
    make_model: Callable[[], nn.Module],
    policy: PolicySpec,
    batch: Batch,
    loss_fn: LossFn,
    make_optimizer: MakeOptimizer = default_optimizer,
    device: str = "cpu",
    fake: bool = True,
) -> LoopEstimate:
    """Build `make_model()` under `policy` on fake tensors (nothing allocated: a model of any size), take one step
    of your loop so the optimizer state and gradients exist, then measure the next one. `batch` (tensors, or a
    structure of them) gives the shapes. `fake=False` runs the same on real tensors: the measurement the estimate
    equals. Figures follow `device`'s kernels where it is the device here, else the CPU's."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    mode: Any = FakeTensorMode() if fake else None
    with mode if mode is not None else contextlib.nullcontext(), torch.device(device):
        model = make_model()
        installed = apply_policy(model, policy if isinstance(policy, Policy) else build_policy(policy))
        model.train()
        optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])

        def place(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            return mode.from_tensor(t.to(device)) if mode is not None else t.to(device)

        step_batch = tree_map(place, batch)
        loop_step(model, optimizer, step_batch, loss_fn)  # the steady state: gradients and optimizer state exist
        meter = StepMeter(device)
        try:
            loop_step(model, optimizer, step_batch, loss_fn, meter)
            figures = meter.end(model)
        except BaseException:
            meter.abort()
            raise
    notes = ["fake tensors: the step's bytes as a real one holds them, nothing allocated"] if fake else []
    return LoopEstimate(
        installed.cfg.name,
        model.activation_plan.describe(),
        figures.activation_bytes,
        figures.total_bytes,
        device,
        notes,
    )


__all__ = [
    "LoopEstimate",
    "apply_policy",
    "check_policy",
    "default_optimizer",
    "estimate_policy",
    "loop_step",
    "remove_policy",
]
