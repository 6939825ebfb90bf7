"""torchtitan: main's command line (`activation-checkpoint:{none,full,selective,memory-budget}` subcommands, names
read from torchtitan 0.3.0) and the older TOML (`[activation_checkpoint] mode`, `selective_ac_option`, read from
0.2.2).

torchtitan wraps each transformer block in torch's checkpoint_wrapper: whole (`full`), per op (`selective` on main,
`selective_ac_option = "op"` up to 0.2), or up to 0.2 every n-th block whole (`selective_ac_option = "<n>"`). Its
per-op policy is its own (saved ops, every second matmul recomputed), so it is replicated here (`TorchtitanSAC`) to
measure it on our model rather than assumed equal to ours. No version offloads activations or checkpoints several
blocks as one region.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

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
    covering_nth,
    every_nth,
    every_nth_plan,
    from_one,
    ordinal,
    register,
    uniform,
)
from trainer.policies import Plan, Policy, PolicyConfig, checkpointed

MAIN = Version("0.3", "torchtitan 0.3.0 (main: command-line subcommands)", "torchtitan")
TOML = Version("0.2", "torchtitan 0.2.2 (TOML, up to 0.2.x)", "torchtitan")
SAC = {MAIN.key: "torchtitan-sac", TOML.key: "torchtitan-0.2-sac"}  # their per-op policy, as a treatment here


def _ops(*names: str) -> set[Any]:
    """Ops by dotted name under torch.ops (or torch._higher_order_ops: "hop.<name>"), skipping those this torch
    lacks, as torchtitan does."""
    out = set()
    for name in names:
        obj: Any = torch.ops
        if name.startswith("hop."):
            obj, name = torch._higher_order_ops, name.removeprefix("hop.")
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            continue
        out.add(obj)
    return out


def main_save_ops() -> set[Any]:
    """torchtitan main's `_get_default_save_ops`: the partitioner's compute-intensive ops, the SDPA kernels it
    names, max, linear, topk and the collectives."""
    from torch._functorch.partitioners import get_default_op_list

    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    return ops | _ops(
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_attention_math.default",
        "aten._scaled_dot_product_fused_attention_overrideable.default",
        "aten.max.default",
        "aten.linear.default",
        "aten.topk.default",
        "_c10d_functional.reduce_scatter_tensor.default",
        "_c10d_functional.all_to_all_single.default",
        "hop.flex_attention",
        "hop.inductor_compiled_code",
        "torch_attn._varlen_attn.default",
    )


def toml_save_ops() -> set[Any]:
    """torchtitan 0.2.2's llama3 `_op_sac_save_list`."""
    return _ops(
        "aten.mm.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_attention_math.default",
        "aten._scaled_dot_product_fused_attention_overrideable.default",
        "_c10d_functional.reduce_scatter_tensor.default",
        "aten.max.default",
        "hop.flex_attention",
        "torch_attn._varlen_attn.default",
        "hop.inductor_compiled_code",
    )


class TorchtitanSAC(Policy):
    """torchtitan's per-op policy on one block, as its `_wrap_block` decides: save the listed ops' outputs except
    every second matmul (counted apart in the forward and in the recompute), recompute the rest. Main counts
    aten.mm and aten.linear, 0.2 aten.mm only; a fresh count per checkpoint call, as torchtitan's context_fn makes."""

    name = "torchtitan-sac"

    def __init__(self, save: set[Any], counted: tuple[Any, ...], name: str) -> None:
        super().__init__(PolicyConfig(name=name))
        self.save, self.counted = save, counted

    def context_fn(self) -> Any:
        count = {"forward": 0, "recompute": 0}

        def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            mode = "recompute" if ctx.is_recompute else "forward"
            if func in self.counted:
                count[mode] += 1
            if func in self.save and not (func in self.counted and count[mode] % 2 == 0):
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(decide)

    def run(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, key: int) -> torch.Tensor:
        return checkpointed(fn, x, context_fn=self.context_fn)

    def effective(self, attention: str) -> str:
        return self.cfg.name  # the name the measured plan gives it (one per torchtitan version)

    @classmethod
    def of(cls, version: Version) -> TorchtitanSAC:
        if version.key == MAIN.key:
            counted = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)
            return cls(main_save_ops(), counted, SAC[version.key])
        return cls(toml_save_ops(), (torch.ops.aten.mm.default,), SAC[version.key])


@register
class Torchtitan(Target):
    name = "torchtitan"
    title = "torchtitan"
    versions = (MAIN, TOML)
    show_all_versions = True
    own_treatments = tuple(SAC.values())

    def candidates(self, ctx: ExportInput, version: Version) -> list[Candidate]:
        n, main = ctx.n_layer, version.key == MAIN.key
        out: list[Candidate] = []
        only = uniform(ctx.plan)
        if only == "none":
            out.append(self._mode("none", Plan.uniform(n, "none"), main))
        nth = None if main else every_nth(ctx.plan, from_one)
        if nth:
            out.append(self._nth(n, nth))
        sac = SAC[version.key]
        out.append(self._mode("selective", Plan.uniform(n, sac), main, {sac: TorchtitanSAC.of(version)}))
        if not main and (cover := covering_nth(ctx.plan, from_one)) and cover != nth:
            out.append(self._nth(n, cover))
        full = self._mode("full", Plan.uniform(n, "full"), main)
        return [full, *out] if only == "full" else [*out, full]

    @staticmethod
    def _mode(mode: str, plan: Plan, main: bool, custom: dict[str, Policy] | None = None) -> Candidate:
        if main:
            settings: dict[str, Any] = {"activation_checkpoint": mode, "args": [f"activation-checkpoint:{mode}"]}
        else:
            settings = {"activation_checkpoint": {"mode": mode} | ({"selective_ac_option": "op"} if custom else {})}
        return Candidate(f"{mode} (per op)" if custom else mode, settings, plan, dict(custom or {}))

    @staticmethod
    def _nth(n: int, k: int) -> Candidate:
        settings = {"activation_checkpoint": {"mode": "selective", "selective_ac_option": str(k)}}
        return Candidate(f"every {ordinal(k)} block", settings, every_nth_plan(n, k, from_one))

    def fidelity(self, e: Element, ctx: ExportInput, version: Version) -> tuple[Status, str] | None:
        if e.treatment == "none":
            return EXACT, "not wrapped: every activation kept"
        if e.treatment == "full" and e.group == 1:
            nth = every_nth(ctx.plan, from_one) if version.key == TOML.key else None
            how = (
                f'selective_ac_option = "{nth}": every {ordinal(nth)} block (counted from 1, by a process-wide '
                "counter) wrapped whole"
                if nth
                else "each block wrapped whole"
            )
            return EXACT, f"{how} (checkpoint_wrapper, RNG state preserved as ours: preserve_rng_state)"
        return None

    def similar(self, e: Element, theirs: str, ctx: ExportInput, version: Version) -> str | None:
        if theirs not in SAC.values() or e.group > 1:
            return None
        own = (
            "the compute-intensive ops (mm, addmm, bmm, SDPA, …) and linear"
            if version.key == MAIN.key
            else "mm and the SDPA kernels"
        )
        if e.treatment == "op_sac":
            ours = ", ".join(getattr(ctx.treatment("op_sac").cfg, "save_ops", []))
            return (
                f"torchtitan's per-op policy saves {own} and recomputes every second matmul; ours saves "
                f"{ours} (matching it takes a SelectiveAC subclass overriding get_save_ops and _wrap_block)"
            )
        if e.treatment == "selective":
            return (
                f"torchtitan has no core-attention-only mode; its per-op policy saves {own} and recomputes every "
                "second matmul and the pointwise ops, where ours recomputes the attention core alone"
            )
        return None

    def why_not(self, e: Element, ctx: ExportInput, version: Version) -> str:
        if e.group > 1:
            return "torchtitan wraps each block on its own, never several blocks as one checkpointed region"
        if e.treatment == "offload":
            return "torchtitan has no activation offload"
        if version.key == MAIN.key:
            return (
                "torchtitan main runs one mode on every block (activation-checkpoint:none|full|selective|"
                "memory-budget); choosing blocks went with ≤0.2's selective_ac_option"
            )
        return 'torchtitan ≤0.2 checkpoints every block, none, or every n-th (selective_ac_option = "<n>")'

    def loss(self, ctx: ExportInput, version: Version) -> LossMap:
        if ctx.loss.name == "standard":
            return LossMap.standard("CrossEntropyLoss on the whole logits (the default)")
        if version.key == TOML.key:
            return LossMap.standard_only("torchtitan ≤0.2.2 has no chunked loss head")
        seq = ctx.config.seq_len  # it chunks the sequence: the first divisor of it making chunks no larger than ours
        chunks = next((d for d in range(ctx.loss_chunks, seq + 1) if seq % d == 0), seq)
        code = f"loss=ChunkedLossWrapper.Config(num_chunks={chunks}, loss_fn=CrossEntropyLoss.Config()),"
        why = (
            "ChunkedLossWrapper (in a config_registry function; it has no command-line form): lm_head and the "
            f"loss per chunk of the sequence ({chunks} chunks of {seq // chunks} positions × the batch), each "
            "chunk's backward run inside the forward"
        )
        extra = (
            ", so nothing is recomputed (ours recomputes each chunk's logits: one head forward more)"
            if ctx.loss.name == "chunked"
            else ", as torch's linear_cross_entropy makes gradients in the forward"
        )
        return LossMap(APPROX, why + extra, {"loss": code}, ctx.loss.name)

    def render(self, chosen: Candidate, loss: LossMap, ctx: ExportInput, version: Version) -> str:
        s = chosen.settings["activation_checkpoint"]
        if version.key == MAIN.key:
            cls = {"none": "None", "full": "FullAC.Config()", "selective": "SelectiveAC.Config()"}[s]
            lines = [f"activation-checkpoint:{s}", f"# or in a config_registry function: activation_checkpoint={cls},"]
            if "loss" in loss.settings:
                lines.append(f"# loss (config_registry only): {loss.settings['loss']}")
            return "\n".join(lines)
        lines = ["[activation_checkpoint]"] + [f'{k} = "{v}"' for k, v in s.items()]
        return "\n".join(lines)
