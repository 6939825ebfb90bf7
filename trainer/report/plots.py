"""The report's figures: memory vs throughput with its Pareto front, and the loss curves (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.measure import metrics as M
from trainer.policies import POLICIES


def _policy_colors(jobs: list[Any]) -> dict[str | None, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    order = list(POLICIES)  # registration order, as the tables list them
    policies = sorted(
        {j.policy for j in jobs}, key=lambda p: (order.index(p), "") if p in order else (len(order), str(p))
    )
    return {p: cmap(i % 10) for i, p in enumerate(policies)}


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both lower memory (x) and higher throughput (y), by memory."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


SPLIT_MARKERS = ("o", "s", "^", "D", "v", "P", "h", "<", ">")


def point_positions(jobs: list[Any], metric: str) -> tuple[dict[int, tuple[float, float]], float, bool]:
    """Where each job goes on the Pareto plot: (memory, tokens/s); a job with no memory figure goes to a right
    edge, one with no throughput to the bottom. Returns ({id(job): (x, y)}, the right edge, whether it is used)."""
    xs = [x for j in jobs if (x := j.get(metric)) is not None]
    edge = (max(xs) if xs else 1.0) * 1.15
    where = {}
    at_edge = 0
    for j in jobs:
        x, y = j.get(metric), j.get(M.TOKENS_PER_S_KEY)
        if x is None:  # side by side along the edge rather than on top of each other
            x, at_edge = edge * (1 + 0.025 * at_edge), at_edge + 1
        where[id(j)] = (x, 0.0 if y is None else y)
    return where, edge, at_edge > 0


def _legend(
    jobs: list[Any],
    colors: dict[str | None, Any],
    markers: dict[Any, str],
    splits: list[Any],
    done_ids: set[int],
    front: bool,
) -> list[Any]:
    """The Pareto plot's legend: the policies and splits of the completed jobs drawn, the front, the failures."""
    from matplotlib.lines import Line2D

    shown = [p for p in colors if any(id(j) in done_ids and j.policy == p for j in jobs)]
    handles = [Line2D([], [], ls="", marker="o", color=colors[p], label=p or "?") for p in shown]
    if len(splits) > 1 or done_ids:
        handles += [
            Line2D(
                [],
                [],
                ls="",
                marker=markers[s],
                color="grey",
                markeredgecolor="black",
                label=f"micro-batch {s[0]} × accum {s[1]}",
            )
            for s in splits
            if any(id(j) in done_ids and (j.batch_size, j.accum) == s for j in jobs)
        ]
    if front:
        handles.append(Line2D([], [], color="black", alpha=0.6, label="Pareto front"))
    if any(j.status == "oom" for j in jobs):
        handles.append(Line2D([], [], ls="", marker="x", color="crimson", mew=2.4, label="OOM (memory reached)"))
    if any(id(j) not in done_ids and j.status != "oom" for j in jobs):
        handles.append(Line2D([], [], ls="", marker="X", color="dimgrey", label="error / missing"))
    return handles


def plot_pareto(jobs: list[Any], metric: str, metric_label: str, path: Path, title: str = "") -> int:
    """Memory vs throughput, one point per job; returns the number of points drawn.

    Completed jobs: colour = policy, marker = micro-batch × accum split; the Pareto front (no other completed job
    has both less memory and more throughput) is the staircase. OOM jobs: a red x at the memory they reached;
    error / missing jobs: a grey X. Jobs with no memory figure sit on a dotted line at the right edge."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.5, 6), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = _policy_colors(jobs)
    splits = sorted({(j.batch_size, j.accum) for j in jobs}, key=lambda s: (-(s[0] or 0), s[1] or 0))
    markers = {s: SPLIT_MARKERS[i % len(SPLIT_MARKERS)] for i, s in enumerate(splits)}
    where, edge, edge_used = point_positions(jobs, metric)
    done = [j for j in jobs if j.status == "completed" and j.get(metric) is not None and j.get(M.TOKENS_PER_S_KEY)]
    done_ids = {id(j) for j in done}
    n = 0
    ax.set_xlim(left=0, right=max(x for x, _ in where.values()) * 1.06 if edge_used else edge)
    ys = [y for _, y in where.values()]
    top = (max(ys) if ys and max(ys) > 0 else 1.0) * 1.15
    ax.set_ylim(bottom=-0.03 * top, top=top)  # jobs with no throughput sit whole on the zero line
    placed: list[tuple[float, float]] = []  # label anchors in points, to step a label down past its neighbours
    for j in jobs:
        x, y = where[id(j)]
        if id(j) in done_ids:
            style = dict(
                marker=markers[(j.batch_size, j.accum)],
                s=60,
                color=colors[j.policy],
                edgecolors="black",
                linewidths=0.6,
                zorder=3,
            )
        elif j.status == "oom":
            style = dict(marker="x", s=90, color="crimson", linewidths=2.4, zorder=4)
        else:
            style = dict(marker="X", s=70, color="dimgrey", linewidths=0.5, zorder=4)
        ax.scatter([x], [y], **style)
        n += 1
        if id(j) in done_ids:
            px, py = ax.transData.transform((x, y)) * 72 / fig.dpi  # points, like the offsets
            dy = 4.0
            while any(abs(px - qx) < 50 and abs(py + dy - qy) < 8 for qx, qy in placed):
                dy -= 8
            placed.append((px, py + dy))
            ax.annotate(j.label, (x, y), xytext=(5, dy), textcoords="offset points", fontsize=7)
        else:  # upright, so that failures side by side on the axis keep their labels apart
            ax.annotate(
                f"{j.label} {j.status.upper()}",
                (x, y),
                xytext=(0, 8),
                textcoords="offset points",
                fontsize=7,
                rotation=90,
                ha="center",
                va="bottom",
            )
    front = pareto_front([where[id(j)] for j in done])
    if front:
        fx, fy = zip(*front, strict=True)
        ax.plot(fx, fy, drawstyle="steps-post", color="black", lw=1.2, alpha=0.6, zorder=2)
    if edge_used:
        ax.axvline(edge * 0.985, color="grey", ls=":", lw=1)
        ax.annotate(
            "no memory figure →",
            (edge, 1),
            xycoords=("data", "axes fraction"),
            xytext=(-3, -4),
            textcoords="offset points",
            ha="right",
            va="top",
            fontsize=7,
            color="grey",
        )

    handles = _legend(jobs, colors, markers, splits, done_ids, bool(front))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)

    ax.set_xlabel(f"{metric_label}, MiB ({metric}) — lower is better")
    ax.set_ylabel("throughput, tokens/s — higher is better")
    ax.grid(True, alpha=0.3)
    ax.set_title(title or "memory vs throughput", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return n


def plot_losses(jobs: list[Any], path: Path, title: str = "") -> int:
    """train/loss per job (solid), val/loss (dashed, same colour); returns the number of lines drawn."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 6), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    with_curves = [j for j in jobs if j.curves]
    cmap = colormaps["tab20" if len(with_curves) > 10 else "tab10"]
    lines = 0
    for i, j in enumerate(with_curves):
        color = cmap(i % cmap.N)
        label = f"{j.ident}: {j.label}" + ("" if j.status == "completed" else f" ({j.status})")
        if train := j.curves.get(M.TRAIN_LOSS):
            ax.plot(*zip(*train, strict=True), color=color, lw=1.2, label=label)
            lines += 1
        if val := j.curves.get(M.VAL_LOSS):
            ax.plot(
                *zip(*val, strict=True),
                color=color,
                lw=1.2,
                ls="--",
                marker="o",
                ms=3,
                label=None if train else f"{label} val",
            )
            lines += 1
    if not lines:
        ax.text(0.5, 0.5, "no loss curves in the TensorBoard events", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.plot([], [], color="black", lw=1.2, label="train/loss (solid)")
        ax.plot([], [], color="black", lw=1.2, ls="--", label="val/loss (dashed)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    ax.set_title(title or "loss curves", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return lines
