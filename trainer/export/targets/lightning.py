"""Lightning: `FSDPStrategy(activation_checkpointing_policy={<block class>})` (names read from lightning 2.6.6).

The policy is a set of module classes (or torch's auto-wrap callable): Lightning wraps every module of those classes
in torch's checkpoint_wrapper (non-reentrant, RNG state preserved). No context_fn passes through it, so no per-op
policy, no core-attention-only recompute and no offload; and a class is all or nothing, so no choice of blocks.
"""

from __future__ import annotations

from trainer.export.spec import (
    EXACT,
    Candidate,
    Element,
    ExportInput,
    LossMap,
    Status,
    Target,
    Version,
    register,
    uniform,
)
from trainer.policies import Plan


@register
class Lightning(Target):
    name = "lightning"
    title = "Lightning (FSDPStrategy)"
    versions = (Version("2.6", "lightning 2.6.6", "lightning"),)

    def candidates(self, ctx: ExportInput, version: Version) -> list[Candidate]:
        n = ctx.n_layer
        none = Candidate("no checkpointing", {"activation_checkpointing_policy": None}, Plan.uniform(n, "none"))
        full = Candidate(
            f"checkpoint every {ctx.layer_class.__name__}",
            {"activation_checkpointing_policy": [ctx.layer_path]},
            Plan.uniform(n, "full"),
        )
        return [none, full] if uniform(ctx.plan) == "none" else [full, none]

    def fidelity(self, e: Element, ctx: ExportInput, version: Version) -> tuple[Status, str] | None:
        if e.treatment == "none":
            return EXACT, "no activation_checkpointing_policy: every activation kept"
        if e.treatment == "full" and e.group == 1:
            return EXACT, (
                f"every {ctx.layer_class.__name__} wrapped in torch's checkpoint_wrapper (non-reentrant, "
                "RNG state preserved), as ours"
            )
        return None

    def why_not(self, e: Element, ctx: ExportInput, version: Version) -> str:
        if e.group > 1:
            return "FSDPStrategy checkpoints each block on its own, never several blocks as one region"
        if e.treatment in ("selective", "op_sac", "torchtitan_sac"):
            return "FSDPStrategy's activation_checkpointing_policy names module classes to checkpoint whole, with no per-op policy (no context_fn)"  # noqa: E501
        if e.treatment == "offload":
            return "FSDPStrategy offloads no activation (its cpu_offload moves parameters)"
        return f"activation_checkpointing_policy checkpoints every {ctx.layer_class.__name__} or none of them"

    def loss(self, ctx: ExportInput, version: Version) -> LossMap:
        if ctx.loss.name == "standard":
            return LossMap.standard("your LightningModule's own loss: cross-entropy on the whole logits")
        return LossMap.standard_only(
            "the loss head is your LightningModule's code, not a strategy setting (this "
            "project's trainer.loss.head_loss computes a chunked or fused head)"
        )

    def render(self, chosen: Candidate, loss: LossMap, ctx: ExportInput, version: Version) -> str:
        lines = ["from lightning.pytorch.strategies import FSDPStrategy"]
        if chosen.settings["activation_checkpointing_policy"]:
            cls = ctx.layer_class
            lines += [
                f"from {cls.__module__} import {cls.__qualname__}",
                "",
                f"strategy = FSDPStrategy(activation_checkpointing_policy={{{cls.__qualname__}}})",
            ]
        else:
            lines += ["", "strategy = FSDPStrategy()"]
        return "\n".join(lines)
