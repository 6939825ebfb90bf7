"""Megatron: megatron-core's TransformerConfig, and the command-line flags megatron.training makes from its fields.

Megatron recomputes per layer or per module, never per op: `--recompute-granularity full` with `--recompute-method
block` (the first N layers of each pipeline stage, each its own checkpoint) or `uniform` (consecutive groups of N
layers, one checkpoint each; megatron-core 0.19.2 shortens the last group as we do), or `selective` with
`--recompute-modules` (core_attn by default). Offload is Transformer Engine's CPU offload of the first N layers
(`--cpu-offloading-num-layers`, N < num_layers), which megatron-core refuses together with any recompute.
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
    first_n,
    group_size,
    per_block,
    register,
    uniform,
)
from trainer.policies import Plan

FLAG_ORDER = (
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "recompute_modules",
    "cpu_offloading_num_layers",
    "tensor_model_parallel_size",
    "sequence_parallel",
)


def flags(settings: dict[str, Any]) -> str:
    """TransformerConfig fields as megatron.training's flags: `--` and the field's name with dashes (lists spaced);
    `cpu_offloading` is not a flag: `--cpu-offloading-num-layers N` > 0 sets it; a switch is its flag alone."""
    out = []
    for key in FLAG_ORDER:
        if key in settings:
            v, flag = settings[key], f"--{key.replace('_', '-')}"
            if isinstance(v, bool):  # megatron.training's switches take no value
                out += [flag] if v else []
            else:
                out.append(f"{flag} {' '.join(map(str, v)) if isinstance(v, list) else v}")
    return " ".join(out)


@register
class Megatron(Target):
    name = "megatron"
    title = "Megatron (megatron-core)"
    versions = (Version("0.19", "megatron-core 0.19.2", "megatron-core"),)
    groups = True

    def candidates(self, ctx: ExportInput, version: Version) -> list[Candidate]:
        plan, n = ctx.plan, ctx.n_layer
        out: list[Candidate] = []
        k, first, only = group_size(plan), first_n(plan), uniform(plan)
        offloaded = first_n(plan, "offload") or (n - 1 if only == "offload" else None)
        if only == "none":
            out.append(Candidate("no recompute", {}, plan))
        if k is not None:
            out.append(self._uniform(n, k))
        if first is not None:
            out.append(self._block(n, first))
        if offloaded is not None and n > 1:
            out.append(
                Candidate(
                    f"offload the first {offloaded} layers",
                    {"cpu_offloading": True, "cpu_offloading_num_layers": offloaded},
                    Plan.per_block(["offload"] * offloaded + ["none"] * (n - offloaded)),
                )
            )
        if {"op_sac", "torchtitan_sac", "selective"} & set(plan.treatments):
            out.append(
                Candidate("selective (core_attn)", {"recompute_granularity": "selective"}, Plan.uniform(n, "selective"))
            )
        out.append(self._uniform(n, 1))
        busy = [i for i, t in enumerate(per_block(plan) or ()) if t != "none"]
        if busy and busy[-1] + 1 < n:
            out.append(self._block(n, busy[-1] + 1))  # the first N layers, N covering every busy block
        t = ctx.config.trainer
        if t.tensor_parallel > 1:  # ModelParallelConfig's fields (TransformerConfig inherits them)
            for c in out:
                c.settings |= {
                    "tensor_model_parallel_size": t.tensor_parallel,
                    "sequence_parallel": t.sequence_parallel,
                }
        return out

    @staticmethod
    def _uniform(n: int, k: int) -> Candidate:
        s = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": k}
        return Candidate(f"uniform, groups of {k}" if k > 1 else "full", s, Plan.groups(n, k, "full"))

    @staticmethod
    def _block(n: int, k: int) -> Candidate:
        s = {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": k}
        return Candidate(f"block, the first {k} layers", s, Plan.per_block(["full"] * k + ["none"] * (n - k)))

    def fidelity(self, e: Element, ctx: ExportInput, version: Version) -> tuple[Status, str] | None:
        n = ctx.n_layer
        if e.treatment == "none":
            return EXACT, "no recompute flag for these layers: their activations are kept"
        if e.treatment == "full" and e.group > 1:
            rest = n % e.group
            last = f"{rest} layer" if rest == 1 else f"{rest} layers"
            tail = (
                f"; the last group has {last}, as ours (megatron-core 0.19.2 shortens it; 0.16.1's loop has no "
                f"such clamp and indexes past the last layer: there give a policy.k dividing {n})"
                if rest
                else ""
            )
            return EXACT, f"--recompute-method uniform: one checkpoint per group of {e.group} layers{tail}"
        if e.treatment == "full":
            method = (
                "--recompute-method block: the first N layers of each pipeline stage (one stage here)"
                if first_n(ctx.plan)
                else "--recompute-method uniform with groups of 1: every layer"
            )
            return EXACT, (
                f"each layer one checkpoint of its input ({method}); tensor_parallel.checkpoint, whose RNG "
                "tracker replays dropout as ours"
            )
        if e.treatment == "selective":
            return (
                EXACT,
                "--recompute-modules core_attn (its default): QKᵀ, softmax, dropout and ·V recomputed, as ours",
            )
        if e.treatment == "offload":
            return APPROX, (
                "Transformer Engine's CPU offload (needs transformer-engine) moves these layers' "
                "activations to the host, as ours; copies on its own schedule, not our prefetch"
            )
        return None

    def similar(self, e: Element, theirs: str, ctx: ExportInput, version: Version) -> str | None:
        if e.treatment in ("op_sac", "torchtitan_sac") and theirs == "selective":
            return (
                "Megatron has no per-op policy: --recompute-modules names modules (core_attn, layernorm, mlp, "
                "moe_act, …); core_attn recomputes the attention core only, where ours also recomputes every "
                "pointwise op and keeps only the matmuls' outputs"
            )
        return None

    def why_not(self, e: Element, ctx: ExportInput, version: Version) -> str:
        if e.treatment in ("op_sac", "torchtitan_sac"):
            return "Megatron has no per-op recompute policy"
        if e.treatment == "offload":
            return (
                f"megatron-core offloads at most num_layers - 1 = {ctx.n_layer - 1} layers (the first ones) and "
                "never together with recompute"
            )
        return (
            "Megatron picks the recomputed layers by --recompute-method only (the first N, or groups of N, of "
            "each pipeline stage) and one granularity for all of them, not an arbitrary mix"
        )

    def loss(self, ctx: ExportInput, version: Version) -> LossMap:
        if ctx.loss.name == "standard":
            return LossMap.standard("Megatron's cross-entropy on the whole logits (vocab-parallel across tensor ranks)")
        return LossMap.standard_only(
            "megatron-core has no chunked or projection-fused loss head (--cross-entropy-loss-fusion fuses the "
            "softmax and the loss, not the projection)"
        )

    def render(self, chosen: Candidate, loss: LossMap, ctx: ExportInput, version: Version) -> str:
        text = flags(chosen.settings)
        return text or "# no recompute or offload flags: Megatron keeps every activation by default"
