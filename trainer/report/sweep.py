"""Read a sweep (or one run) and write what a team reads: a table, a Pareto plot, loss curves.

    python -m trainer.report runs/sweeps/<stamp> [--budget MiB] [--metric auto|peak_allocated_mib|...]

Every job folder (one with a summary.json or a .hydra/ folder) becomes one row, whatever became of it:
`completed`, `oom` and `error` come from its summary.json (with whatever figures it reached), `missing` is a
job that left no summary.json (killed). Figures a summary lacks are taken from the job's TensorBoard events
where it logged them. Written into the folder:

  report.md         the table (markdown), failures with their one-line reason, the two plots
  report.csv        the same rows, raw numbers
  pareto.png        memory vs throughput, one point per job, the Pareto front, OOM jobs marked
  loss_curves.png   train/loss per job, val/loss dashed

The memory figure for the plot and the budget is CUDA's peak allocated when the jobs ran on a GPU, otherwise the
whole-step peak when every completed job recorded one (`peak_total_mib`: weights, gradients, optimizer state and
activations, from the live-tensor tracker on CPU), otherwise the activation peak (live tensors of one micro-batch's
forward and backward); the report says which, and `--metric` picks one.
"""

from __future__ import annotations

import csv
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainer.formatting import markdown_table as _table
from trainer.loss import LOSSES
from trainer.measure import metrics as M
from trainer.policies import POLICIES
from trainer.report.plots import plot_losses, plot_pareto

STATUS_ORDER = ("completed", "oom", "error", "interrupted", "missing")

METRICS = {
    M.PEAK_ALLOCATED_KEY: "CUDA peak allocated",
    M.PEAK_TOTAL_KEY: "whole-step peak",
    M.ACTIVATION_PEAK_KEY: "activation peak",
}
METRIC_NOTES = {
    M.PEAK_ALLOCATED_KEY: "torch.cuda.max_memory_allocated over a step, after warm-up (GPU)",
    M.PEAK_TOTAL_KEY: "every live tensor at the step's peak — weights, gradients, optimizer state, activations; "
    "the allocator's peak on CUDA, the live-tensor tracker's on tracked CPU steps",
    M.ACTIVATION_PEAK_KEY: "live tensors of one micro-batch's forward+backward above what was live before it, "
    "gradients excluded (measured on any device; on CPU the only per-policy memory figure)",
}
FIGURES = M.REPORT_FIGURES


@dataclass(eq=False)  # a job is itself: compared by identity
class Job:
    path: Path
    name: str  # folder, relative to the report's folder ("." for a single run)
    num: int | None = None
    status: str = "missing"
    policy: str | None = None
    loss: str | None = None
    batch_size: int | None = None
    accum: int | None = None
    precision: str | None = None
    seq_len: int | None = None
    model: str | None = None
    device: str | None = None
    overrides: str = ""
    error: str | None = None
    figures: dict[str, float | None] = field(default_factory=dict)
    from_events: list[str] = field(default_factory=list)  # figures filled from the events, not the summary
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # metrics.TRAIN_LOSS, VAL_LOSS
    baseline: Job | None = None
    baseline_exact: bool = False
    mem_ratio: float | None = None
    time_ratio: float | None = None
    step_ms_spread: float | None = None  # IQR / median of the timed steps, from the events

    def get(self, key: str) -> float | None:
        return self.figures.get(key)

    @property
    def label(self) -> str:
        split = f" {self.batch_size}×{self.accum}" if self.batch_size is not None and self.accum is not None else ""
        head = f"+{self.loss}" if self.loss and self.loss != "standard" else ""
        return f"{self.policy or '?'}{head}{split}"

    @property
    def ident(self) -> str:
        return str(self.num) if self.num is not None else self.name


# --- reading -------------------------------------------------------------------------------------------------------
def is_job_dir(path: Path) -> bool:
    return (path / "summary.json").is_file() or (path / ".hydra" / "config.yaml").is_file()


def find_jobs(root: Path) -> list[Path]:
    """The job folders under `root`: `root` itself for a single run, else every folder holding a job."""
    if is_job_dir(root):
        return [root]
    found: list[Path] = []

    def walk(d: Path) -> None:
        for child in sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if is_job_dir(child):
                found.append(child)
            elif child.name not in ("tb", "checkpoints"):
                walk(child)  # override_dirname with a "/" in a value nests folders

    walk(root)
    return found


def _load_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        return None


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def read_job(path: Path, root: Path) -> Job:
    name = path.name if path == root else path.relative_to(root).as_posix()
    job = Job(path=path, name=name)
    cfg = _load_yaml(path / ".hydra" / "config.yaml") or {}
    hydra = (_load_yaml(path / ".hydra" / "hydra.yaml") or {}).get("hydra", {}) or {}
    overrides = _load_yaml(path / ".hydra" / "overrides.yaml")
    job.overrides = ",".join(str(o) for o in overrides) if isinstance(overrides, list) else ""
    num = (hydra.get("job") or {}).get("num")
    if isinstance(num, int):
        job.num = num
    elif m := re.match(r"(\d+)_", path.name):
        job.num = int(m.group(1))

    summary: dict[str, Any] = {}
    summary_path = path / "summary.json"
    if summary_path.is_file():
        try:
            summary = json.loads(summary_path.read_text())
            job.status = str(summary.get("status") or "completed")
        except (OSError, ValueError) as e:
            job.status, job.error = "missing", f"summary.json unreadable: {e}"
    else:
        job.error = "no summary.json: the job was killed or is still running"
    if summary.get("error"):
        job.error = str(summary["error"]).strip().splitlines()[0] if str(summary["error"]).strip() else None

    policy_cfg = cfg.get("policy")
    job.policy = summary.get("policy") or (policy_cfg.get("name") if isinstance(policy_cfg, dict) else policy_cfg)
    for key in ("batch_size", "accum", "seq_len"):
        value = summary.get(key, cfg.get(key))
        setattr(job, key, int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None)
    job.precision = summary.get("precision") or cfg.get("precision")
    loss = summary.get("loss") if isinstance(summary.get("loss"), dict) else cfg.get("loss")
    job.loss = loss.get("name") if isinstance(loss, dict) else None
    model = summary.get("model") if isinstance(summary.get("model"), dict) else cfg.get("model")
    job.model = (model or {}).get("name") if isinstance(model, dict) else None
    job.device = summary.get("device")
    job.figures = {k: _num(summary.get(k)) for k in FIGURES}

    scalars = read_scalars(path)
    job.curves = {tag: scalars[tag] for tag in (M.TRAIN_LOSS, M.VAL_LOSS) if tag in scalars}
    for key, (tag, how) in M.FROM_TAG.items():  # figures the summary lacks, from the events
        if job.figures.get(key) is None and scalars.get(tag):
            values = [v for _, v in scalars[tag]]
            if how == "median":
                values = values[1:] or values  # leave the first (warm-up) step out
            job.figures[key] = float(M.reduce(values, how) or 0)  # values is not empty: never None
            job.from_events.append(key)
    warmup = (cfg.get("measure") or {}).get("warmup_steps", 3) if isinstance(cfg.get("measure"), dict) else 3
    job.step_ms_spread = step_time_spread(scalars, int(warmup) if isinstance(warmup, int) else 3)
    return job


def step_time_spread(scalars: dict[str, list[tuple[int, float]]], warmup: int) -> float | None:
    """Interquartile range of the timed steps' wall time over their median (the steps summary.json's median is
    taken over: after warm-up, tracked steps left out); None with fewer than 4 such steps."""
    tracked = {s for s, _ in scalars.get(M.ACTIVATION_PEAK, [])}
    times = [v for s, v in scalars.get(M.STEP_MS, []) if s > warmup and s not in tracked]
    if len(times) < 4:
        return None
    q1, median, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / median if median > 0 else None


def read_scalars(job_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a job's TensorBoard events (in its folder, or its tb/ folder as older runs wrote
    them), as (step, value) lists; {} when there are none."""
    if not job_dir.is_dir():
        return {}
    files = sorted(job_dir.glob("events.out.tfevents.*"))
    if (job_dir / "tb").is_dir():
        files += sorted((job_dir / "tb").rglob("events.out.tfevents.*"))
    if not files:
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for run_dir in sorted({f.parent for f in files}):
        try:
            acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
            acc.Reload()
            for tag in acc.Tags().get("scalars", []):
                out.setdefault(tag, []).extend((e.step, float(e.value)) for e in acc.Scalars(tag))
        except Exception:  # a truncated events file of a killed job: keep what was read
            continue
    return {tag: sorted(points) for tag, points in out.items()}


def read_jobs(root: Path) -> list[Job]:
    return sort_jobs([read_job(p, root) for p in find_jobs(root)])


# --- arranging -----------------------------------------------------------------------------------------------------
def _rank(seq: tuple[str, ...], value: str | None) -> tuple[int, str]:
    return (seq.index(value), "") if value in seq else (len(seq), str(value))


def sort_key(job: Job) -> tuple[Any, ...]:
    return (
        _rank(STATUS_ORDER, job.status),
        _rank(tuple(POLICIES), job.policy),
        _rank(LOSSES, job.loss),
        -(job.batch_size or 0),  # the largest micro-batch (fewest accumulation steps) first
        job.accum or 0,
        job.precision or "",
        job.num if job.num is not None else 1 << 30,
        job.name,
    )


def sort_jobs(jobs: list[Job]) -> list[Job]:
    return sorted(jobs, key=sort_key)


def choose_metric(jobs: list[Job], metric: str = "auto") -> str:
    """The memory figure for the plot and the budget (see the module doc)."""
    if metric != "auto":
        if metric not in METRICS:
            raise ValueError(f"--metric {metric!r}; choose one of: auto, {', '.join(METRICS)}")
        return metric
    done = [j for j in jobs if j.status == "completed"] or jobs
    if any(j.get(M.PEAK_ALLOCATED_KEY) is not None for j in done):
        return M.PEAK_ALLOCATED_KEY
    if done and all(j.get(M.PEAK_TOTAL_KEY) is not None for j in done):
        return M.PEAK_TOTAL_KEY
    return M.ACTIVATION_PEAK_KEY


def attach_baselines(jobs: list[Job], metric: str) -> None:
    """Ratios vs the `none` job of the same micro-batch, accum, precision and loss head, else vs the first `none`
    job."""
    nones = [j for j in jobs if j.policy == "none" and j.status == "completed"]

    def split(j: Job) -> tuple[Any, ...]:
        return (j.batch_size, j.accum, j.precision, j.loss)

    for job in jobs:
        same = [n for n in nones if split(n) == split(job)]
        base = same[0] if same else (nones[0] if nones else None)
        job.baseline, job.baseline_exact = base, bool(same)
        if base is None:
            continue
        job.mem_ratio = _ratio(job.get(metric), base.get(metric))
        job.time_ratio = _ratio(job.get(M.MEDIAN_STEP_MS), base.get(M.MEDIAN_STEP_MS))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def best_within(jobs: list[Job], budget_mib: float, metric: str) -> Job | None:
    """The fastest completed job whose memory figure fits the budget."""
    fits = [
        j
        for j in jobs
        if j.status == "completed"
        and j.get(metric) is not None
        and j.get(metric) <= budget_mib  # type: ignore[operator]
        and j.get(M.TOKENS_PER_S_KEY) is not None
    ]
    return max(fits, key=lambda j: j.get(M.TOKENS_PER_S_KEY) or 0.0, default=None)


def budget_line(jobs: list[Job], budget_mib: float, metric: str) -> str:
    what = f"{METRICS[metric]} (`{metric}`)"
    best = best_within(jobs, budget_mib, metric)
    if best is not None:
        return (
            f"Best within {budget_mib:g} MiB of {what}: **{best.policy}** at micro-batch {best.batch_size} × accum "
            f"{best.accum} ({best.precision}) — {_fmt(best.get(M.TOKENS_PER_S_KEY), 0)} tokens/s, "
            f"{_fmt(best.get(metric), 2)} MiB (job {best.ident})"
        )
    measured = [j for j in jobs if j.status == "completed" and j.get(metric) is not None]
    if not measured:
        return f"No completed job has a {what} figure to hold against {budget_mib:g} MiB."
    low = min(measured, key=lambda j: j.get(metric) or 0.0)
    return (
        f"No completed job fits {budget_mib:g} MiB of {what}; the smallest is {low.policy} at micro-batch "
        f"{low.batch_size} × accum {low.accum}: {_fmt(low.get(metric), 2)} MiB (job {low.ident})"
    )


# --- the table -----------------------------------------------------------------------------------------------------
def _fmt(x: float | None, digits: int) -> str:
    if x is None:
        return "—"
    return f"{x:,.{digits}f}"


def columns(jobs: list[Job]) -> list[tuple[str, str, int]]:
    """(header, figure key, digits) of the numeric columns; the whole-step peak column only where measured."""
    cols = [("act. peak MiB", M.ACTIVATION_PEAK_KEY, 2), ("peak alloc MiB", M.PEAK_ALLOCATED_KEY, 1)]  # "—": no CUDA
    if any(j.get(M.PEAK_TOTAL_KEY) is not None for j in jobs):
        cols.append(("step peak MiB", M.PEAK_TOTAL_KEY, 1))
    if any(j.get(M.PREDICTED_ACTIVATION_PEAK_KEY) is not None for j in jobs):  # the run's own prediction
        cols += [("est. act. MiB", M.PREDICTED_ACTIVATION_PEAK_KEY, 2), ("act. err", M.ACTIVATION_PEAK_ERROR, 4)]
    cols += [("step ms", M.MEDIAN_STEP_MS, 1), ("tokens/s", M.TOKENS_PER_S_KEY, 0)]
    return cols


def table_rows(jobs: list[Job]) -> tuple[list[str], list[list[str]]]:
    cols = columns(jobs)
    header = ["job", "policy", "loss", "micro-batch", "accum", "precision", "status", "steps"]
    header += [c[0] for c in cols] + ["mem ×none", "time ×none", "train loss", "val loss"]
    rows = []
    for j in jobs:
        mark = "" if j.baseline_exact or j.baseline is None else "*"
        row = [
            j.ident,
            j.policy or "?",
            j.loss or "—",
            str(j.batch_size) if j.batch_size is not None else "—",
            str(j.accum) if j.accum is not None else "—",
            j.precision or "—",
            j.status if not j.from_events else f"{j.status}†",
            _fmt(j.get(M.STEPS), 0),
        ]
        cells = {key: _fmt(j.get(key), digits) for _, key, digits in cols}
        if j.get(M.MEDIAN_STEP_MS) is not None and j.step_ms_spread is not None:
            cells[M.MEDIAN_STEP_MS] += f" ±{50 * j.step_ms_spread:.0f}%"
        row += [cells[key] for _, key, _ in cols]
        row += [
            f"{j.mem_ratio:.2f}×{mark}" if j.mem_ratio is not None else "—",
            f"{j.time_ratio:.2f}×{mark}" if j.time_ratio is not None else "—",
            _fmt(j.get(M.FINAL_TRAIN_LOSS), 3),
            _fmt(j.get(M.FINAL_VAL_LOSS), 3),
        ]
        rows.append(row)
    return header, rows


def markdown_table(jobs: list[Job]) -> str:
    header, rows = table_rows(jobs)
    text = {1, 2, 5, 6}  # policy, loss, precision, status: left; numbers right
    return _table(header, rows, ["l" if i in text else "r" for i in range(len(header))])


CSV_FIELDS = (
    "job",
    "folder",
    "policy",
    "loss",
    "batch_size",
    "accum",
    "precision",
    "seq_len",
    "model",
    "device",
    "status",
    *FIGURES,
    "step_ms_iqr_over_median",
    "mem_ratio_vs_none",
    "time_ratio_vs_none",
    "baseline_job",
    "figures_from_events",
    "overrides",
    "error",
)


def write_csv(jobs: list[Job], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for j in jobs:
            w.writerow(
                {
                    "job": j.ident,
                    "folder": j.name,
                    "policy": j.policy,
                    "loss": j.loss,
                    "batch_size": j.batch_size,
                    "accum": j.accum,
                    "precision": j.precision,
                    "seq_len": j.seq_len,
                    "model": j.model,
                    "device": j.device,
                    "status": j.status,
                    **{k: j.get(k) for k in FIGURES},
                    "step_ms_iqr_over_median": j.step_ms_spread,
                    "mem_ratio_vs_none": j.mem_ratio,
                    "time_ratio_vs_none": j.time_ratio,
                    "baseline_job": j.baseline.ident if j.baseline is not None else None,
                    "figures_from_events": " ".join(j.from_events),
                    "overrides": j.overrides,
                    "error": j.error,
                }
            )


# --- the report ----------------------------------------------------------------------------------------------------
@dataclass
class Report:
    folder: Path
    jobs: list[Job]
    metric: str
    markdown: str
    budget: str | None
    pareto_points: int
    loss_lines: int
    paths: dict[str, Path]


def _describe(jobs: list[Job]) -> str:
    counts = {s: sum(j.status == s for j in jobs) for s in dict.fromkeys([*STATUS_ORDER, *(j.status for j in jobs)])}
    parts = [f"{n} {s}" for s, n in counts.items() if n]
    facts = []
    for attr, name in (("model", "model"), ("seq_len", "seq_len"), ("device", "device")):
        values = sorted({str(getattr(j, attr)) for j in jobs if getattr(j, attr) is not None})
        if values:
            facts.append(f"{name} {', '.join(values)}")
    return f"{len(jobs)} job{'s' if len(jobs) != 1 else ''}: {', '.join(parts)}" + (
        f" · {' · '.join(facts)}" if facts else ""
    )


def build_report(folder: Path, budget: float | None = None, metric: str = "auto", out: Path | None = None) -> Report:
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder")
    jobs = read_jobs(folder)
    if not jobs:
        raise FileNotFoundError(f"{folder}: no job folders (a summary.json or .hydra/ folder) found")
    metric = choose_metric(jobs, metric)
    attach_baselines(jobs, metric)
    out = Path(out) if out is not None else folder
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in ("report.md", "report.csv", "pareto.png", "loss_curves.png")}
    title = folder.resolve().name
    points = plot_pareto(
        jobs, metric, METRICS[metric], paths["pareto.png"], f"{title}: {METRICS[metric]} vs throughput"
    )
    lines = plot_losses(jobs, paths["loss_curves.png"], f"{title}: loss per job")
    write_csv(jobs, paths["report.csv"])
    budget_text = budget_line(jobs, budget, metric) if budget is not None else None

    md = [f"# Report: {title}", "", _describe(jobs), "", markdown_table(jobs), ""]
    notes = [
        f"Memory for the plot and the budget: **{METRICS[metric]}** (`{metric}`): {METRIC_NOTES[metric]}.",
        "mem ×none and time ×none compare with the `none` job of the same micro-batch, accum, precision and loss head"
        + (
            " (* marks a row compared with the first `none` job instead, having none of its own)."
            if any(j.baseline is not None and not j.baseline_exact for j in jobs)
            else "."
        ),
        "step ms and tokens/s are medians over the steps after warm-up, tracked steps left out; ± is half their "
        "interquartile range, in % of the median: where it is large (a shared or busy machine), so is the noise in "
        "time ×none.",
    ]
    if any(j.from_events for j in jobs):
        notes.append("† figures read from the job's TensorBoard events (its summary.json lacks them).")
    md += [f"- {n}" for n in notes]
    failed = [j for j in jobs if j.status != "completed"]
    if failed:
        md += ["", "## Jobs that did not complete", ""]
        for j in failed:
            what = f" `{j.overrides}`" if j.overrides else ""
            md.append(f"- job {j.ident}{what} — **{j.status}**: {j.error or 'no reason recorded'}")
    if budget_text:
        md += ["", "## Budget", "", budget_text]
    md += ["", "## Plots", "", "![memory vs throughput](pareto.png)", "", "![loss curves](loss_curves.png)", ""]
    markdown = "\n".join(md)
    paths["report.md"].write_text(markdown)
    return Report(folder, jobs, metric, markdown, budget_text, points, lines, paths)


def main(argv: list[str] | None = None) -> int:
    from trainer.core.schema import OneLineParser

    p = OneLineParser(
        prog="python -m trainer.report",
        description=(__doc__ or "").strip(),
    )
    p.add_argument("folder", type=Path, help="a multirun folder (runs/sweeps/<stamp>) or one run's folder")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="MiB",
        help="name the fastest completed job whose memory figure fits this many MiB",
    )
    p.add_argument(
        "--metric",
        default="auto",
        choices=["auto", *METRICS],
        help="memory figure for the plot and the budget (auto: CUDA peak allocated on GPU, else the whole-step "
        "peak peak_total_mib where recorded, else the activation peak)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="FOLDER",
        help="write the report files here instead of into the folder",
    )
    args = p.parse_args(argv)
    if args.budget is not None and not args.budget > 0:  # nan and negatives too
        p.error(f"--budget {args.budget} must be a positive number of MiB")
    try:
        report = build_report(args.folder, args.budget, args.metric, args.out)
    except (OSError, ValueError) as e:  # no such folder, --out not writable, a file where a folder goes
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(_describe(report.jobs))
    print()
    print(markdown_table(report.jobs))
    print()
    print(f"memory figure: {METRICS[report.metric]} ({report.metric})")
    if report.budget:
        print(report.budget.replace("**", ""))
    print(f"wrote {', '.join(str(p) for p in report.paths.values())}")
    return 0
