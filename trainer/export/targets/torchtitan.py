"""torchtitan: main's command line (`activation-checkpoint:{none,full,selective,memory-budget}` subcommands, names
read from torchtitan 0.3.0) and the older TOML (`[activation_checkpoint] mode`, `selective_ac_option`, read from
0.2.2).

torchtitan wraps each transformer block in torch's checkpoint_wrapper: whole (`full`), per op (`selective` on main,
`selective_ac_option = "op"` up to 0.2), or up to 0.2 every n-th block whole (`selective_ac_option = "<n>"`). Its
per-op policy is its own (saved ops, every second matmul recomputed): the registered policy `torchtitan_sac`
(`policy.version` 0.3 or 0.2), so it is measured on our model rather than assumed equal to ours, and a plan of it
exports exactly. No version offloads activations or checkpoints several
blocks as one region.
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
    covering_nth,
    every_nth,
    every_nth_plan,
    from_one,
    ordinal,
    register,
    uniform,
)
from trainer.policies import Plan, Policy, build_policy

MAIN = Version("0.3", "torchtitan 0.3.0 (main: command-line subcommands)", "torchtitan")
TOML = Version("0.2", "torchtitan 0.2.2 (TOML, up to 0.2.x)", "torchtitan")
SAC = "torchtitan_sac"  # their per-op policy, a registered treatment (trainer/policies/library.py)


@register
class Torchtitan(Target):
    name = "torchtitan"
    title = "torchtitan"
    versions = (MAIN, TOML)
    show_all_versions = True

    def candidates(self, ctx: ExportInput, version: Version) -> list[Candidate]:
        n, main = ctx.n_layer, version.key == MAIN.key
        out: list[Candidate] = []
        only = uniform(ctx.plan)
        if only == "none":
            out.append(self._mode("none", Plan.uniform(n, "none"), main))
        nth = None if main else every_nth(ctx.plan, from_one)
        if nth:
            out.append(self._nth(n, nth))
        theirs = build_policy({"name": SAC, "version": version.key})
        out.append(self._mode("selective", Plan.uniform(n, SAC), main, {SAC: theirs}))
        if not main and (cover := covering_nth(ctx.plan, from_one)) and cover != nth:
            out.append(self._nth(n, cover))
        full = self._mode("full", Plan.uniform(n, "full"), main)
        chosen = [full, *out] if only == "full" else [*out, full]
        training = training_precision(ctx.precision)
        parallelism = tensor_parallelism(ctx.config.trainer)
        for c in chosen:
            c.settings["training"] = training
            if parallelism:
                c.settings["parallelism"] = parallelism
            if main:  # flags before the subcommand: tyro reads what follows it as the subcommand's own
                c.settings["args"] = [
                    *[f"--training.{k}={v}" for k, v in training.items()],
                    *[_flag("parallelism", k, v) for k, v in parallelism.items()],
                    *c.settings["args"],
                ]
        return chosen

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
        if e.treatment == SAC and e.group == 1:
            planned = ctx.treatment(SAC).cfg.version
            if planned == version.key:
                return EXACT, "its own per-op policy on every block (saved ops, every second matmul recomputed)"
            return APPROX, f"this version's per-op policy, whose save list is not policy.version={planned}'s"
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
        if theirs != SAC or e.group > 1:
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
        s, training = chosen.settings["activation_checkpoint"], chosen.settings["training"]
        note = [f"# {NO_FP16}"] if ctx.precision == "16-mixed" else []
        if version.key == MAIN.key:
            cls = {"none": "None", "full": "FullAC.Config()", "selective": "SelectiveAC.Config()"}[s]
            lines = [
                " ".join(chosen.settings["args"]),
                *note,
                f"# or in a config_registry function: activation_checkpoint={cls},",
            ]
            if "loss" in loss.settings:
                lines.append(f"# loss (config_registry only): {loss.settings['loss']}")
            return "\n".join(lines)
        lines = ["[activation_checkpoint]"] + [f'{k} = "{v}"' for k, v in s.items()]
        lines += ["", "[training]"] + [f'{k} = "{v}"' for k, v in training.items()] + note
        if parallelism := chosen.settings.get("parallelism"):
            lines += ["", "[parallelism]"] + [f"{k} = {str(v).lower()}" for k, v in parallelism.items()]
        return "\n".join(lines)


NO_FP16 = "torchtitan trains in bf16 or fp32 only: precision=16-mixed has no torchtitan form (fp32 written)"


def _flag(section: str, key: str, value: Any) -> str:
    """One field as torchtitan's command line takes it (tyro): a switch as itself or its no- form."""
    if isinstance(value, bool):
        return f"--{section}.{'' if value else 'no-'}{key.replace('_', '-')}"
    return f"--{section}.{key}={value}"


def tensor_parallelism(trainer: Any) -> dict[str, Any]:
    """trainer.tensor_parallel / sequence_parallel as torchtitan's [parallelism] fields (0.3.0's ParallelismConfig;
    FSDP's degree is left to its default, -1: the ranks TP does not take, as ours). Empty without TP."""
    if trainer.tensor_parallel == 1:
        return {}
    return {"tensor_parallel_degree": trainer.tensor_parallel, "enable_sequence_parallel": trainer.sequence_parallel}


def training_precision(precision: str) -> dict[str, str]:
    """Our precision as torchtitan's [training] fields (names read from 0.3.0's TrainingConfig, the same in 0.2).
    bf16-mixed is its mixed_precision_param=bfloat16 with fp32 gradient reduction: FSDP2's MixedPrecisionPolicy
    under FSDP (our trainer=fsdp2 default), autocast on one device or DDP, as ours; bf16-true is training.dtype
    bfloat16 (no fp32 master weights)."""
    if precision == "bf16-mixed":
        return {"mixed_precision_param": "bfloat16", "mixed_precision_reduce": "float32"}
    if precision == "bf16-true":
        return {"dtype": "bfloat16"}
    return {"mixed_precision_param": "float32"}
