"""`python -m trainer.estimate` with trainer.pipeline_parallel > 1: every pipeline rank estimated
(trainer.estimate.pipeline), printed as one table, its step time with the bubble, the fewest layers each rank
recomputes under --budget, and the same as JSON; what the pipeline estimate does not cover is refused first, in one
line. Kept apart from cli.py, whose tables are one process's.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from trainer.core import resolve
from trainer.core.rundir import write_json_atomic
from trainer.errors import UserError
from trainer.estimate.pipeline import bubble, estimate_pipeline, fit_ranks, rank_total
from trainer.estimate.session import estimate_device
from trainer.formatting import budget_size, markdown_table, mib
from trainer.measure.time.calibration import speed_for
from trainer.parallel.pipeline import PipelineLayout
from trainer.policies import build_policy


def pipeline_main(args: Any, config: Any, pipeline: PipelineLayout, budget: int | None) -> int:
    """trainer.pipeline_parallel > 1: every rank's steady-state step on fake tensors (trainer.estimate.pipeline),
    printed as one table and, with --json, written; what the pipeline estimate does not cover is refused first."""
    flags = (("--fit", args.fit), ("--advise", args.advise), ("--compile-vs-eager", args.compile_vs_eager))
    others = (("--gpu", args.gpu), ("--alloc-conf", args.alloc_conf), ("--autocast-cache", args.autocast_cache))
    for flag, given in (*flags, *others):  # --policies: stages are estimated under the configured policy only
        if given:
            raise UserError(f"{flag} does not take pipeline stages yet; drop it (or trainer.pipeline_parallel)")
    device = estimate_device(config, args.device)
    if device != "cpu":
        raise UserError(f"trainer.pipeline_parallel is estimated for the CPU only yet; add --device cpu (not {device})")
    chosen, _ = resolve.settle_precision(config, device, estimate=True)
    if chosen != "32-true":
        raise UserError(f"trainer.pipeline_parallel is estimated in fp32 only yet, not {chosen}: add precision=32-true")
    ranks = estimate_pipeline(config, pipeline)
    speed = None if args.no_time else speed_for(device, None, args.catalogue)
    compute = [speed.predict(r.figures.work).ms if speed and r.figures.work else None for r in ranks]
    slowest = max((ms for ms in compute if ms is not None), default=None)
    step_ms = None if slowest is None else slowest * (1 + bubble(pipeline))
    per = f"{pipeline.virtual} stages a rank, " if pipeline.virtual > 1 else ""
    replicas = config.trainer.devices // pipeline.ranks
    copies = f", the pipeline replicated on {replicas} data-parallel ranks alike" if replicas > 1 else ""
    policy = build_policy(config.policy).name
    head = (
        f"{config.model.name}, policy={policy}: {pipeline.n_stages} pipeline stages on {pipeline.ranks} "
        f"ranks{copies} ({per}{pipeline.schedule} over accum={pipeline.n_microbatches} micro-batches of "
        f"{config.batch_size} × {config.seq_len} tokens), each rank's steady-state step on fake tensors: activations "
        "are the micro-batches "
        "in flight (P2P buffers included); the step's peak adds the stages' gradients; the total is the whole step's "
        "peak as train.py takes it: the parameters and AdamW's state held, the update after the schedule (fp32)."
    )
    rows = [
        [
            str(r.rank),
            ", ".join(f"{s} ({lay.start}-{lay.stop - 1})" for s, lay in zip(r.stages, r.layers, strict=True)),
            mib(r.figures.parameters),
            mib(r.figures.activations),
            mib(r.figures.peak),
            mib(rank_total(r.figures)),
        ]
        + ([] if ms is None else [f"{ms:,.1f}"])
        for r, ms in zip(ranks, compute, strict=True)
    ]
    columns = ["rank", "stages (layers)", "parameters MiB", "activations MiB", "step peak MiB", "total MiB"]
    if step_ms is not None:
        columns.append("compute ms")
    table = markdown_table(columns, rows, "llrrrrr"[: len(columns)])
    print(f"{head}\n\n{table}")
    if step_ms is not None and speed is not None:
        print(
            f"\nstep ≈ {step_ms:,.1f} ms on {speed.name}: the slowest rank's {slowest:,.1f} ms of compute (all its "
            f"micro-batches) plus the pipeline's bubble, {bubble(pipeline):.0%} of it ((p − 1)/(v·m), Narayanan et al. "
            "2021: stages of equal time; the P2P transfers are not costed)."
        )
    fit = None if budget is None else fit_ranks(config, pipeline, budget)
    if fit is not None:
        assert budget is not None
        fits, plan = fit
        each = "; ".join(
            f"rank {f.rank}: {f.recomputed} of {f.layers}, {mib(f.total)} MiB" + ("" if f.fits else " (does not fit)")
            for f in fits
        )
        print(
            f"\nto fit {budget_size(budget)} a rank (its total), the fewest leading layers of each rank recomputed "
            f"(full, the rest none): {each}. As one plan: policy=per_block 'policy.blocks=[{','.join(plan)}]'"
        )
    if args.json_path:
        doc = {
            "pipeline": {"ranks": pipeline.ranks, "schedule": pipeline.schedule, "virtual": pipeline.virtual}
            | {"n_microbatches": pipeline.n_microbatches, "micro_batch": [config.batch_size, config.seq_len]},
            "per_rank": [
                {"rank": r.rank, "stages": r.stages, "layers": [[lay.start, lay.stop] for lay in r.layers]}
                | {"peak": r.figures.peak, "activations": r.figures.activations, "parameters": r.figures.parameters}
                | {"total": rank_total(r.figures), "compute_ms": ms}
                for r, ms in zip(ranks, compute, strict=True)
            ],
            "bubble": bubble(pipeline),
            "step_ms": step_ms,
        }
        if fit is not None:
            doc["budget_bytes"] = budget
            doc["fit"] = {"plan": fit[1], "ranks": [f._asdict() for f in fit[0]]}
        path = Path(args.json_path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, doc)
        except OSError as e:
            why = e.strerror or e
            print(f"error: --json {path}: cannot write it ({why}); the estimate is printed above", file=sys.stderr)
            return 2
    return 0
