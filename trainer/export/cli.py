"""`python -m trainer.export --to TARGET <overrides>`: the configured plan and loss head in another trainer's own
settings, how faithful each element is, and what the difference costs (the estimator's figures, side by side)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from trainer.core.rundir import check_writable, write_json_atomic, write_text_atomic
from trainer.core.schema import Config, OneLineParser, compose_config, user_error_status
from trainer.estimate import Session, estimate_device, open_session, planner_plan
from trainer.export.fidelity import (
    EXACT,
    Measurer,
    PlanFigures,
    TargetSettings,
    export_form,
    quiet_policy_notices,
    rows,
)
from trainer.export.spec import TARGETS, ExportInput, ExportRefused, Target, settings_line, target
from trainer.formatting import MIB, flops_text, markdown_table
from trainer.policies import PolicyError, build_policy, resolve_plan


@dataclass
class ExportResult:
    """Everything the command prints and writes: the forms (one per target version shown), and what they are for."""

    ctx: ExportInput
    forms: list[TargetSettings]
    refused: dict[str, str]  # version key → its one line, where one version of several cannot express the plan
    planner: str


def unsharded_class(layer: torch.nn.Module) -> type:
    """The model's own block class: FSDP2 (trainer=fsdp2) swaps a sharded module's class for a generated subclass
    (FSDP<name>, bases FSDPModule and the original), which no user can import."""
    cls = type(layer)
    from torch.distributed.fsdp import FSDPModule

    if issubclass(cls, FSDPModule):
        return next(b for b in cls.__bases__ if b is not FSDPModule)
    return cls


def build_context(config: Config, device: str) -> tuple[ExportInput, Session, str]:
    """Our plan as the estimator makes it: a planned policy (auto) planned first on fake tensors, then the session
    the figures are measured on (closed here if the policy refuses this model), and the plan as it runs on it."""
    policy = build_policy(config.policy)
    if policy.caps.requires_compile:  # its cut is the compiler's, so there is no plan of ours to map
        raise PolicyError(
            f"policy {policy.name}: not exported: decided by torch.compile's partitioner (torchtitan's peer is "
            "activation-checkpoint:memory-budget with activation_checkpoint.memory_budget, under compile)"
        )
    with quiet_policy_notices():
        if config.model.family != "hf" or policy.caps.planned_first:  # refused before any work (policy.k=9, no budget)
            policy.check(config.model.n_layer or 0, config.model.attention)  # (a planner's budget needs no depth)
    planner = ""
    if policy.caps.planned_first:
        plan, loss_name, planner = planner_plan(config, device)
        policy.choose(plan.treatments)
        if loss_name and loss_name != config.loss.name:
            config.loss = replace(config.loss, name=loss_name)
    session = open_session(config, device)
    adapter = session.module.adapter
    try:
        with quiet_policy_notices():
            policy.check(adapter.n_layer, adapter.attention)  # an HF model's depth is known only now
            plan = resolve_plan(policy, adapter)
    except BaseException:
        session.close()
        raise
    model = session.module.model
    rates = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    rates.append(float(getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0))
    ctx = ExportInput(
        config,
        policy,
        plan,
        adapter.n_layer,
        adapter.attention,
        unsharded_class(adapter.layers[0]),
        max(rates),
        session.device,
        session.precision,
    )
    return ctx, session, planner


def export(config: Config, to: str, version: str | None = None, device: str | None = None) -> ExportResult:
    """The whole answer for one target (every version it shows, or the one asked for); ExportRefused when it
    cannot express the plan at all."""
    t = target(to)
    chosen = t.selected(version)  # an unknown --target-version: one line, before any work
    ctx, session, planner = build_context(config, estimate_device(config, device))
    try:
        measurer = Measurer(session, ctx)
        forms: list[TargetSettings] = []
        refused: dict[str, str] = {}
        for v in chosen:
            try:
                forms.append(export_form(t, ctx, v, measurer, explicit=version is not None))
            except ExportRefused as e:
                if len(chosen) == 1:
                    raise
                refused[v.key] = str(e)
        if not forms:
            raise ExportRefused(next(iter(refused.values())))
        if version is not None:
            _refuse_if_another_version_has_it(t, ctx, forms[0])
    finally:
        session.close()
    return ExportResult(ctx, forms, refused, planner)


def _refuse_if_another_version_has_it(t: Target, ctx: ExportInput, form: TargetSettings) -> None:
    """--target-version V where V cannot write our plan exactly and another version of the target can: an option V
    lacks, refused naming the version that has it."""
    if all(r.status == EXACT for r in form.rows[:-1]):
        return
    for other in t.versions:
        if other.key == form.version.key:
            continue
        for c in t.candidates(ctx, other):
            if c.does == ctx.plan and all(r.status == EXACT for r in rows(t, ctx, other, c, form.loss)[:-1]):
                setting = settings_line(t.render(c, form.loss, ctx, other))
                raise ExportRefused(
                    f"--to {t.name} --target-version {form.version.key}: policy={ctx.policy.cfg.name} "
                    f"({ctx.plan.describe()}) needs {c.label} ({setting}), which {form.version.read_from} "
                    f"lacks ({other.read_from} has it: --target-version {other.key})"
                )


# ----------------------------------------------------------------------------------------------------
# What is printed and written.
# ----------------------------------------------------------------------------------------------------


def render(answer: ExportResult) -> str:
    ctx = answer.ctx
    name = ctx.config.model.name
    lines = [
        f"model {name}: {ctx.n_layer} layers ({ctx.layer_path}), attention={ctx.attention}; "
        f"policy={ctx.policy.cfg.name}: {ctx.plan.describe()}; loss={ctx.loss_text}"
    ]
    if answer.planner:
        lines.append("(policy=auto planned as the estimator plans it, on fake tensors; its explanation is in --json)")
    for form in answer.forms:
        lines += ["", *_form_lines(form, ctx.device)]
    for key, why in answer.refused.items():
        lines += ["", f"── {answer.forms[0].target.version(key).read_from}: not expressible: {why}"]
    return "\n".join(lines)


def _form_lines(form: TargetSettings, device: str) -> list[str]:
    lines = [f"── export to {form.target.title}: {form.target.names(form.version)}", "", "settings:"]
    lines += [f"  {s}" for s in form.text.splitlines()]
    cells = [(r.element, r.status, r.how) for r in form.rows]
    table = markdown_table(("element of our plan", "fidelity", "how"), cells)
    lines += ["", f"fidelity: {form.verdict}", table]
    if form.ours is not None and form.closest is not None:
        lines += [
            "",
            f"ours beside the closest plan {form.target.name} can write ({form.chosen.label}): the "
            f"estimator's figures for one optimizer step (--device {device}):",
            _figures(form),
        ]
    return lines + [f"note: {n}" for n in form.notes]


def _figures(form: TargetSettings) -> str:
    assert form.ours is not None and form.closest is not None
    base = form.ours.flops or 1

    def row(who: str, f: PlanFigures) -> tuple[str, ...]:
        return (
            who,
            f.plan,
            f.loss,
            f"{f.activation_bytes / MIB:,.2f}",
            f"{f.peak_bytes / MIB:,.2f}",
            f"{flops_text(f.flops)} ({f.flops / base:.3f}×)",
        )

    header = ("plan", "runs", "loss", "activation peak MiB", "whole-step peak MiB", "FLOPs (× ours)")
    return markdown_table(header, [row("ours", form.ours), row("closest", form.closest)], "lllrrr")


def to_json(answer: ExportResult) -> dict[str, Any]:
    ctx = answer.ctx

    def one(form: TargetSettings) -> dict[str, Any]:
        v, exact = form.version, form.verdict == EXACT
        return {
            "version": v.key,
            "names_read_from": v.read_from,
            "names": form.target.names(v),
            "installed": {v.package: v.installed()} if v.package else {},
            "settings": {**form.chosen.settings, **form.loss.settings},
            "text": form.text,
            "verdict": form.verdict,
            "fidelity": [asdict(r) for r in form.rows],
            "closest": None if exact else {"label": form.chosen.label, "runs": form.chosen.does.describe()},
            "figures": None if form.ours is None else {"ours": asdict(form.ours), "closest": asdict(form.closest)},
            "notes": form.notes,
        }

    forms = [one(f) for f in answer.forms]
    return {
        "target": answer.forms[0].target.name,
        "model": ctx.config.model.name,
        "n_layer": ctx.n_layer,
        "attention": ctx.attention,
        "device": ctx.device,
        "policy": ctx.policy.cfg.name,
        "plan": ctx.plan.describe(),
        "loss": asdict(ctx.loss) | {"chunk_tokens_used": ctx.chunk_tokens},
        "planner": answer.planner or None,
        **forms[0],
        "forms": forms,
        "refused_versions": answer.refused,
    }


# ----------------------------------------------------------------------------------------------------
# The command.
# ----------------------------------------------------------------------------------------------------


def _parser() -> OneLineParser:
    import trainer.export as package

    parser = OneLineParser(prog="python -m trainer.export", description=(package.__doc__ or "").split("\n\nInside:")[0])
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides, the same as for train.py (policy=first_k policy.k=2)"
    )
    parser.add_argument("--to", required=True, metavar="TARGET", help=f"the trainer to write for: {', '.join(TARGETS)}")
    parser.add_argument(
        "--target-version",
        metavar="V",
        help="one release of the target to write for (default: every form the target has, each shown)",
    )
    parser.add_argument("--out", metavar="FILE", help="write the settings, in the target's own form, to this file")
    parser.add_argument(
        "--json", dest="json_path", metavar="PATH", help="write the whole answer (settings, fidelity, figures) as JSON"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="the device the figures are estimated for (default: cuda if the run would train on one, else cpu)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)  # options may come before, between or after the overrides
    try:
        target(args.to)
        for flag, path in (("--out", args.out), ("--json", args.json_path)):
            if path:
                check_writable(flag, Path(path))  # before the work, not after it
        if args.out and args.json_path and Path(args.out).resolve() == Path(args.json_path).resolve():
            raise ExportRefused(f"--out and --json both name {args.out}; give each a file of its own")
        answer = export(compose_config(args.overrides), args.to, args.target_version, args.device)
    except Exception as e:
        return user_error_status(e)
    print(render(answer))
    try:
        if args.out:
            write_text_atomic(Path(args.out), answer.forms[0].text.rstrip("\n") + "\n")
        if args.json_path:
            path = Path(args.json_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, to_json(answer))
    except OSError as e:
        print(
            f"error: cannot write {e.filename or ''} ({e.strerror or e}); the settings are printed above",
            file=sys.stderr,
        )
        return 2
    return 0
