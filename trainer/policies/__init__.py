"""Activation-memory policies: the registry (the only list of policies), the Plan, and `apply_policy(model, cfg)`.

A policy decides, per decoder layer ("block"), how its activations survive until the backward. It says so as a
`Plan`: segments of consecutive blocks, each run by one *treatment*:

  none       keep everything (autograd's default)
  full       keep only the segment's input; recompute its blocks in backward (torch.utils.checkpoint)
  selective  keep everything but the core attention (GQA repeat, QKᵀ, softmax, dropout, ·V), recomputed
  op_sac     per op: save the listed ops' outputs (matmuls, attention kernels), recompute the rest (torch SAC)
  offload    keep everything, in host memory instead of the device

A segment of one block is that block's treatment; a segment of several blocks is ONE region (`sqrt`, `every_k`:
"full-group"). Treatments are policies too (`caps = Capabilities(treatment=True)`): `per_block` and `auto` name
them per block, and the registry is the one list of them. What a policy is and needs (a treatment, recomputes,
planned before it runs, needs compile, the callbacks it brings) is its one frozen `Capabilities` record; what a
treatment does is the `Treatment` protocol (run, effective, unavailable), what plans blocks is `Planner` (check,
plan, choose). Adding a policy is one class in library.py and one yaml in conf/policy/.

`apply_policy` installs a plan through the decoder contract (models/adapter.py) and nothing else: a recomputed
segment replaces its layers' `forward` (an instance attribute; the segment runs at its last layer's call, with
every layer's own arguments, and the layers before it pass the residual stream through), and `selective` wraps
each layer's attention seam. No module is wrapped, so `state_dict` keys never change and a checkpoint moves freely
between policies; wrapping (torch's `checkpoint_wrapper`, which keeps keys too) could not express one region
spanning several layers. Recompute uses non-reentrant checkpointing with the RNG state preserved, so dropout
replays the same masks and gradients equal `none`'s bit for bit where the arithmetic is the same.
"""

from __future__ import annotations

from trainer.errors import PolicyError
from trainer.policies import library
from trainer.policies.base import (
    POLICIES,
    Capabilities,
    CompositeConfig,
    Plan,
    Planner,
    Policy,
    PolicyConfig,
    Segment,
    Treatment,
    build_policy,
    check_treatments,
    checkpointed,
    config_node,
    moved_parameter,
    needs_attention_seam,
    no_seam_refusal,
    policy_params,
    register,
    resolve_plan,
    say_once,
    treatments,
)
from trainer.policies.install import apply_policy, install_plan, remove_policy
from trainer.policies.library import *  # noqa: F403

__all__ = [
    "POLICIES",
    "Capabilities",
    "CompositeConfig",
    "Plan",
    "Planner",
    "Policy",
    "PolicyConfig",
    "PolicyError",
    "Segment",
    "Treatment",
    "apply_policy",
    "build_policy",
    "config_node",
    "moved_parameter",
    "check_treatments",
    "checkpointed",
    "install_plan",
    "needs_attention_seam",
    "no_seam_refusal",
    "policy_params",
    "register",
    "remove_policy",
    "resolve_plan",
    "say_once",
    "treatments",
    *library.__all__,
]
