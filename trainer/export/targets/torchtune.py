"""torchtune: the recipe YAML keys (names read from torchtune 0.6.1's recipes and torchtune.training).

`enable_activation_checkpointing: true` wraps every TransformerSelfAttentionLayer in torch's checkpoint_wrapper (RNG
state preserved). `ac_mode: selective` with `ac_option: <n>` (read by the distributed recipes only, and only with
enable_activation_checkpointing false) wraps every n-th layer (counted from 1, by a counter kept on the function
across models) with preserve_rng_state=False, so with dropout the recompute draws new masks. `enable_activation_
offloading: true` (CUDA only, and only with enable_activation_checkpointing true) moves what the checkpoints keep to
the host. 0.6.1 has no per-op policy (ac_option "op" fails its int() parse) and no recipe key for the offloader's
streams.
"""

from __future__ import annotations

from typing import Any

from trainer.export.spec import (
    APPROX,
    EXACT,
    Candidate,
    Element,
    ExportInput,
    LossMap,
    Status,
    Target,
    Version,
    checkpoint_and_offload,
    covering_nth,
    every_nth,
    every_nth_plan,
    from_one,
    offload_by_checkpoint,
    ordinal,
    register,
    uniform,
)
from trainer.policies import Plan

RECIPES = "full_finetune_distributed, qat_distributed"  # the recipes that read ac_mode / ac_option


@register
class Torchtune(Target):
    name = "torchtune"
    title = "torchtune (recipe YAML)"
    versions = (Version("0.6", "torchtune 0.6.1", "torchtune"),)

    def candidates(self, ctx: ExportInput, version: Version) -> list[Candidate]:
        n, plan = ctx.n_layer, ctx.plan
        only = uniform(plan)
        off = {"enable_activation_checkpointing": False}
        full = Candidate(
            "enable_activation_checkpointing", {"enable_activation_checkpointing": True}, Plan.uniform(n, "full")
        )
        out: list[Candidate] = []
        if only == "none":
            out.append(Candidate("no checkpointing", off, plan))
        if nth := every_nth(plan, from_one):
            out.append(self._nth(n, nth))
        if "offload" in plan.treatments:
            s = {"enable_activation_checkpointing": True, "enable_activation_offloading": True}
            out.append(checkpoint_and_offload(n, s))
        out.append(full)
        if (cover := covering_nth(plan, from_one)) and cover != nth:
            out.append(self._nth(n, cover))
        return out

    @staticmethod
    def _nth(n: int, k: int) -> Candidate:
        s: dict[str, Any] = {"enable_activation_checkpointing": False, "ac_mode": "selective", "ac_option": k}
        return Candidate(f"every {ordinal(k)} layer", s, every_nth_plan(n, k, from_one))

    def fidelity(self, e: Element, ctx: ExportInput, version: Version) -> tuple[Status, str] | None:
        if e.treatment == "none":
            return EXACT, "not wrapped: every activation kept"
        if e.treatment == "full" and e.group == 1:
            nth = every_nth(ctx.plan, from_one)
            if not nth:
                return EXACT, "each layer wrapped in torch's checkpoint_wrapper (RNG state preserved), as ours"
            how = (
                f"ac_mode: selective, ac_option: {nth} (the {RECIPES} recipes): every {ordinal(nth)} layer wrapped, "
                "counted from 1 by a counter that carries over to the next model built in the process"
            )
            if ctx.dropout > 0:
                return APPROX, (
                    f"{how}; with preserve_rng_state=False, so at dropout {ctx.dropout:g} the recompute "
                    "draws new masks: the gradients differ from ours (bytes and FLOPs do not)"
                )
            return EXACT, f"{how} (no dropout, so its preserve_rng_state=False changes nothing)"
        if e.treatment == "offload" and e.group == 1:
            return offload_by_checkpoint(
                "enable_activation_offloading needs enable_activation_checkpointing (and "
                "CUDA): each layer is checkpointed and what the checkpoint keeps (its "
                "input) goes to the host"
            )
        return None

    def why_not(self, e: Element, ctx: ExportInput, version: Version) -> str:
        if e.group > 1:
            return "torchtune wraps each layer on its own, never several layers as one region"
        if e.treatment in ("selective", "op_sac", "torchtitan_sac"):
            return 'torchtune 0.6.1 has no per-op or core-attention policy (ac_option "op" fails its int() parse)'
        return "torchtune checkpoints every layer, none, or every n-th (ac_mode: selective, ac_option: n)"

    def loss(self, ctx: ExportInput, version: Version) -> LossMap:
        if ctx.loss.name == "standard":
            s = {"loss": {"_component_": "torch.nn.CrossEntropyLoss"}}
            return LossMap.standard("torch's CrossEntropyLoss on the whole logits", s)
        chunks = ctx.loss_chunks
        s = {"loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss", "num_output_chunks": chunks}}
        return LossMap(
            APPROX,
            (
                f"CEWithChunkedOutputLoss ({chunks} chunks): the output layer still makes every "
                "chunk's logits in the forward and keeps them; only the fp32 upcast and the "
                "cross-entropy go chunk by chunk. Measured here as loss=standard"
            ),
            s,
            "standard",
        )

    def render(self, chosen: Candidate, loss: LossMap, ctx: ExportInput, version: Version) -> str:
        lines = [f"{k}: {_yaml(v)}" for k, v in chosen.settings.items()]
        for key, node in loss.settings.items():
            lines.append(f"{key}:")
            lines += [f"  {k}: {_yaml(v)}" for k, v in node.items()]
        return "\n".join(lines)


def _yaml(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)
