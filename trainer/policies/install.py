"""Installing a plan on a model through the decoder contract (models/adapter.py) and nothing else: forward
overrides for the segments a treatment runs other than as they are, the attention seam for `selective`, and the
group runner that makes several blocks one region."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from models.adapter import DecoderAdapter, adapter_for
from trainer.errors import PolicyError
from trainer.policies.base import (
    Plan,
    Policy,
    Segment,
    Treatment,
    build_policy,
    checkpointed,
    no_seam_refusal,
    resolve_plan,
)

log = logging.getLogger(__name__)


def apply_policy(model: nn.Module, cfg: Policy | Mapping[str, Any] | DictConfig | str) -> Policy:
    """Install a policy on any model that meets the decoder contract (models/adapter.py).

    Idempotent and reversible: a previous policy is removed first; `remove_policy` restores the plain model. A
    policy the model refuses (PolicyError) leaves the installed one in place.
    """
    policy = cfg if isinstance(cfg, Policy) else build_policy(cfg)
    adapter = adapter_for(model)
    policy.check(adapter.n_layer, adapter.attention)
    planned = policy.plan(adapter.n_layer)
    plan = resolve_plan(policy, adapter, planned)
    wanted = planned.treatments
    if not adapter.has_attention_seam and any(policy.treatment_policy(t).caps.recomputes_core for t in wanted):
        raise no_seam_refusal(policy, type(model).__name__)
    if any(seg.group for seg in plan.segments) and not adapter.layer_output.groupable:
        raise PolicyError(
            f"policy {policy.cfg.name}: {type(model).__name__}'s decoder loop {adapter.layer_output.why_not_groupable}"
            ", so blocks cannot be grouped into one region; choose full, first_k or per_block for this model"
        )
    remove_policy(model)
    install_plan(adapter, plan, policy)
    if any(policy.treatment_policy(s.treatment).caps.replays_forward for s in plan.segments):
        _no_kv_cache_in_training(model)
    model.activation_policy = policy  # type: ignore[assignment]  # read by the callbacks and summaries
    model.activation_plan = plan  # type: ignore[assignment]
    return policy


def remove_policy(model: nn.Module) -> None:
    hook = model.__dict__.pop("_no_kv_cache_hook", None)
    if hook is not None:
        hook.remove()
    adapter = adapter_for(model)
    for i in range(adapter.n_layer):
        adapter.override_forward(i, None)
        adapter.wrap_core_attention(i, None)
    model.__dict__.pop("activation_policy", None)
    model.__dict__.pop("activation_plan", None)


_KV_CACHE_NOTICE = (
    "use_cache=False while training: a recomputed layer would append its keys and values to the KV cache a second "
    "time (eager attention then fails in backward), and the cache would hold every layer's through the step; eval "
    "and generation keep the cache"
)


def _no_kv_cache_in_training(model: nn.Module) -> None:
    """A model that takes `use_cache` (Hugging Face's) runs training forwards without its KV cache, as transformers'
    own gradient checkpointing does: the recompute replays the layer's cache update. Eval and generation keep it."""
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False) or "use_cache" not in inspect.signature(model.forward).parameters:
        return

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict]:
        if module.training and kwargs.get("use_cache") is not False:
            kwargs["use_cache"] = False
        return args, kwargs

    model.__dict__["_no_kv_cache_hook"] = model.register_forward_pre_hook(hook, with_kwargs=True)
    log.warning("%s: %s", type(model).__name__, _KV_CACHE_NOTICE)  # said, as transformers says it


def install_plan(adapter: DecoderAdapter, plan: Plan, policy: Policy) -> None:
    """Put `plan` on the layers: core-attention wrappers for treatments that recompute it, forward overrides for
    segments whose treatment runs them other than as they are."""
    if plan.n_layer != adapter.n_layer:
        raise PolicyError(
            f"policy {policy.cfg.name}: the plan covers {plan.n_layer} blocks, the model has {adapter.n_layer}"
        )
    for seg in plan.segments:
        tp = policy.treatment_policy(seg.treatment)
        if tp.caps.recomputes_core:
            for i in range(seg.start, seg.stop):
                adapter.wrap_core_attention(i, checkpointed)
        if type(tp).run is Policy.run:  # runs its blocks as they are (none, selective): nothing to override
            continue
        if seg.group:
            runner = _GroupRunner(adapter, seg, tp)
            for i in range(seg.start, seg.stop):
                adapter.override_forward(i, functools.partial(runner.forward, i))
        else:
            adapter.override_forward(
                seg.start, functools.partial(_run_one, adapter.original_forward(seg.start), tp, seg.start)
            )


def _run_one(
    forward: Callable[..., torch.Tensor], tp: Treatment, key: int, hidden: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    return tp.run(lambda x: forward(x, *args, **kwargs), hidden, key)


class _GroupRunner:
    """Several blocks as one region. The model's loop calls each layer in turn; the layers before the last pass the
    residual stream through and note their arguments, and the last layer's call runs the whole segment under the
    treatment, each block with its own arguments. Inside the segment (and its recompute in backward) the earlier
    layers are called through the module again, so hooks on them (FSDP2's all-gather) still fire."""

    def __init__(self, adapter: DecoderAdapter, seg: Segment, tp: Treatment) -> None:
        self.adapter, self.seg, self.tp = adapter, seg, tp
        self.calls: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self.inside = False

    def forward(self, i: int, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.inside:
            return self.adapter.original_forward(i)(hidden, *args, **kwargs)
        self.calls[i] = (args, kwargs)
        output = self.adapter.layer_output  # what the loop reads from a layer's return (the tensor, or its [0])
        if i < self.seg.stop - 1:
            return output.stand_in(hidden)
        calls = [self.calls.pop(j) for j in range(self.seg.start, self.seg.stop)]
        last = self.adapter.original_forward(i)  # its module call is the one running now
        layers = self.adapter.layers

        def run(x: torch.Tensor) -> Any:
            self.inside = True
            try:
                for j, (a, kw) in zip(range(self.seg.start, self.seg.stop), calls, strict=True):
                    out = (last if j == i else layers[j])(x, *a, **kw)
                    x = output.hidden_of(out)
                    if not isinstance(x, torch.Tensor):
                        raise PolicyError(
                            f"policy {self.tp.cfg.name}: {type(layers[j]).__name__} returns {type(out).__name__}, "
                            "not the hidden states its model's loop reads, so its blocks cannot be grouped; choose "
                            "full or per_block"
                        )
            finally:
                self.inside = False
            return out

        return self.tp.run(run, hidden, self.seg.start)
