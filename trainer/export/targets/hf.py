"""Hugging Face transformers: the `TrainingArguments` keyword arguments its users pass to `Trainer`.

Hugging Face checkpoints each decoder layer (a `GradientCheckpointingLayer`) through torch.utils.checkpoint with the
kwargs given, forwarding any it does not know (so `context_fn`, torch's per-op policy, passes through). The names
are read from the installed transformers: 5.24 calls them `activation_checkpointing` / `activation_checkpointing_kwargs`
(`gradient_checkpointing*` are its deprecated aliases, the names of earlier releases) and takes `every_n_layers`
(layers 0, n, 2n, … checkpointed) and `offload` (the checkpoint's saved input in pinned host memory) in the kwargs;
an older transformers lacks them, and a plan that needs one is refused naming the release that has it.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from trainer.export.spec import (
    APPROX,
    EXACT,
    Candidate,
    Element,
    ExportInput,
    ExportRefused,
    LossMap,
    Status,
    Target,
    Version,
    checkpoint_and_offload,
    covering_nth,
    every_nth,
    every_nth_plan,
    from_zero,
    offload_by_checkpoint,
    register,
    uniform,
)
from trainer.policies import Plan

READ_FROM = "5.24.0"  # where every_n_layers and offload were read; the names below when transformers is missing


@dataclasses.dataclass(frozen=True)
class Names:
    """What the installed transformers calls things and takes."""

    version: str
    flag: str
    kwargs: str
    every_n_layers: bool
    offload: bool


def hf_names() -> Names:
    try:
        import transformers
        from transformers import PreTrainedModel, TrainingArguments
    except ImportError:
        return Names(READ_FROM, "activation_checkpointing", "activation_checkpointing_kwargs", True, True)
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    new = "activation_checkpointing" in fields
    enable = getattr(PreTrainedModel, "activation_checkpointing_enable", None)
    enable = enable or PreTrainedModel.gradient_checkpointing_enable
    params = inspect.signature(enable).parameters
    prefix = "activation" if new else "gradient"
    return Names(
        transformers.__version__,
        f"{prefix}_checkpointing",
        f"{prefix}_checkpointing_kwargs",
        "every_n_layers" in params,
        "offload" in params,
    )


LIGER = {"fused_linear_cross_entropy": True, "cross_entropy": False, "rope": False, "rms_norm": False, "swiglu": False}


@register
class HuggingFace(Target):
    name = "hf"
    title = "Hugging Face transformers (TrainingArguments)"
    versions = (Version("5", f"transformers {READ_FROM}", "transformers"),)

    def names(self, v: Version) -> str:
        if v.installed() is None:
            return super().names(v)
        return (
            f"names for transformers {hf_names().version}, the one installed here (read from its "
            "TrainingArguments and activation_checkpointing_enable)"
        )

    def candidates(self, ctx: ExportInput, version: Version) -> list[Candidate]:
        names, n, plan = hf_names(), ctx.n_layer, ctx.plan
        only = uniform(plan)
        out: list[Candidate] = []
        if only == "none":
            out.append(Candidate("no checkpointing", {}, plan))
        nth = every_nth(plan, from_zero)
        if nth:
            self._needs(names, "every_n_layers", ctx)
            out.append(self._ckpt(names, {"every_n_layers": nth}, every_nth_plan(n, nth, from_zero)))
        if "offload" in plan.treatments:
            if only == "offload":
                self._needs(names, "offload", ctx)
            if names.offload:
                c = self._ckpt(names, {"offload": True}, Plan.uniform(n, "full"))
                out.append(checkpoint_and_offload(n, c.settings, c.notes))
        if {"op_sac", "torchtitan_sac", "selective"} & set(plan.treatments):
            context_fn = ctx.treatment("op_sac").context_fn  # type: ignore[attr-defined]
            out.append(self._ckpt(names, {"context_fn": context_fn}, Plan.uniform(n, "op_sac"), "per op"))
        out.append(self._ckpt(names, {}, Plan.uniform(n, "full")))
        cover = covering_nth(plan, from_zero) if names.every_n_layers else None
        if cover and cover != nth:
            out.append(self._ckpt(names, {"every_n_layers": cover}, every_nth_plan(n, cover, from_zero)))
        return out

    def _needs(self, names: Names, option: str, ctx: ExportInput) -> None:
        """Refuse a plan that needs the checkpointing kwarg `option` (a `Names` field) the installed release lacks."""
        if not getattr(names, option):
            raise ExportRefused(
                f"--to hf: policy={ctx.policy.cfg.name} ({ctx.plan.describe()}) needs {names.kwargs} {option}, "
                f"which transformers {names.version} lacks ({READ_FROM} has it); upgrade transformers, or export "
                "policy=full"
            )

    @staticmethod
    def _ckpt(names: Names, extra: dict[str, Any], plan: Plan, label: str = "") -> Candidate:
        kwargs = {"use_reentrant": False, **extra}
        what = label or ", ".join(f"{k}={v}" for k, v in extra.items()) or "every layer"
        notes = []
        if names.flag == "activation_checkpointing":
            notes.append(
                "gradient_checkpointing=True, gradient_checkpointing_kwargs={…} are this release's deprecated "
                "aliases and the names of releases before it (which take no every_n_layers or offload)"
            )
        return Candidate(f"checkpointing ({what})", {names.flag: True, names.kwargs: kwargs}, plan, notes=notes)

    def fidelity(self, e: Element, ctx: ExportInput, version: Version) -> tuple[Status, str] | None:
        if e.treatment == "none":
            return EXACT, "not checkpointed: every activation kept"
        if e.treatment == "full" and e.group == 1:
            nth = every_nth(ctx.plan, from_zero)
            which = f"every_n_layers={nth}: layers 0, {nth}, {2 * nth}, … checkpointed" if nth else "each layer"
            return EXACT, f"{which} (torch.utils.checkpoint, use_reentrant=False, RNG state preserved as ours)"
        if e.treatment == "op_sac" and e.group == 1:
            return EXACT, (
                "context_fn: torch's selective-checkpoint contexts with our decision (policy.save_ops), "
                "passed through to torch.utils.checkpoint; a Python object, so this form fits a script, "
                "not a JSON or command-line config"
            )
        if e.treatment == "offload" and e.group == 1:
            return offload_by_checkpoint(
                "offload=True checkpoints each layer and holds what the checkpoint keeps "
                "(its input) in pinned host memory (torch's save_on_cpu)"
            )
        return None

    def similar(self, e: Element, theirs: str, ctx: ExportInput, version: Version) -> str | None:
        if e.treatment == "selective" and theirs == "op_sac" and e.group == 1:
            return (
                "no core-attention-only mode: a per-op context_fn (ours, saving policy.save_ops) recomputes the "
                "attention core under eager attention (its bmm are not saved) and the pointwise ops too"
            )
        if e.treatment == "torchtitan_sac" and theirs == "op_sac" and e.group == 1:
            return (
                "a per-op context_fn saving policy.save_ops (op_sac's list): torchtitan's save list and its "
                "every-second-matmul rule are not written into the script"
            )
        return None

    def why_not(self, e: Element, ctx: ExportInput, version: Version) -> str:
        if e.group > 1:
            return "Hugging Face checkpoints each decoder layer on its own call, never several layers as one region"
        return (
            "Hugging Face checkpoints every layer or every n-th (every_n_layers: layers 0, n, 2n, …), one "
            "context_fn for all"
        )

    def loss(self, ctx: ExportInput, version: Version) -> LossMap:
        if ctx.loss.name == "standard":
            return LossMap.standard("the model's own loss: cross-entropy on the whole logits")
        settings = {"use_liger_kernel": True, "liger_kernel_config": dict(LIGER)}
        why = (
            "Liger's fused linear cross-entropy (liger-kernel 0.8.5; Triton kernels, CUDA only): projection and "
            "loss chunk by chunk, gradients made in the forward"
        )
        if ctx.loss.name == "chunked":
            why += ", so nothing is recomputed (ours recomputes each chunk's logits); Liger sizes its own chunks"
        return LossMap(APPROX, why, settings, ctx.loss.name)

    def render(self, chosen: Candidate, loss: LossMap, ctx: ExportInput, version: Version) -> str:
        names = hf_names()
        settings = {**chosen.settings, **loss.settings}
        kwargs = settings.get(names.kwargs, {})
        if "context_fn" in kwargs:
            save = ", ".join(f"torch.ops.{op}" for op in ctx.treatment("op_sac").cfg.save_ops)  # type: ignore[attr-defined]
            head = [
                "import functools",
                "",
                "import torch",
                "from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts",
                "from transformers import TrainingArguments",
                "",
                f"SAVE = {{{save}}}  # policy.save_ops",
                "",
                "",
                "def save_listed(ctx, op, *args, **kwargs):",
                '    packet = getattr(op, "overloadpacket", op)',
                "    return CheckpointPolicy.MUST_SAVE if packet in SAVE else CheckpointPolicy.PREFER_RECOMPUTE",
                "",
                "",
            ]
        else:
            head = ["from transformers import TrainingArguments", ""]
        lines = ["training_args = TrainingArguments("]
        for key, value in settings.items():
            lines.append(f"    {key}={_py(value)},")
        return "\n".join([*head, *lines, ")"])


def _py(value: Any) -> str:
    """A settings value as Python source (context_fn as the partial the script above defines)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f'"{k}": {_py(v)}' for k, v in value.items()) + "}"
    if callable(value):
        return "functools.partial(create_selective_checkpoint_contexts, save_listed)"
    return repr(value)
