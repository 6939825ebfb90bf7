"""TensorBoard's Custom Scalars layout for a run: memory, time and throughput charts side by side.

The Scalars tab shows one chart per tag; the Custom Scalars tab shows the charts named here, several tags on
one chart, each drawn for every run under the logdir — so `tensorboard --logdir <sweep folder>` puts every
job's activation peak on one chart. Chart tags are regular expressions over the tags of callbacks/measure.py;
a chart whose tags a run never logs (CUDA counters on CPU) stays empty.

Wiring (trainer/run.py, right after the TensorBoardLogger is made):

    write_tb_layout(logger.experiment)
"""

from __future__ import annotations

from typing import Any

# category -> chart title -> (chart kind, tag regexes). "Multiline": one line per tag and run.
LAYOUT: dict[str, dict[str, list[Any]]] = {
    "memory": {
        "activation peak (MiB, live tensors of one micro-batch)": ["Multiline", [r"memory/activation_peak_mib"]],
        "CUDA peak allocated / reserved (MiB)": [
            "Multiline",
            [r"memory/peak_allocated_mib", r"memory/peak_reserved_mib"],
        ],
        "CUDA allocator retries": ["Multiline", [r"memory/alloc_retries"]],
    },
    "time": {
        "optimizer step (ms)": ["Multiline", [r"time/step_ms"]],
        "throughput (tokens/s)": ["Multiline", [r"throughput/tokens_per_s"]],
    },
    "loss": {
        "train and val loss": ["Multiline", [r"train/loss", r"val/loss"]],
    },
}


def tb_layout() -> dict[str, dict[str, list[Any]]]:
    """A copy of the layout, in the form `SummaryWriter.add_custom_scalars` takes."""
    return {
        cat: {title: [kind, list(tags)] for title, (kind, tags) in charts.items()} for cat, charts in LAYOUT.items()
    }


def write_tb_layout(writer: Any) -> None:
    """Write the layout into a run's events through its SummaryWriter (`TensorBoardLogger.experiment`).

    torch's and tensorboardX's SummaryWriter both have `add_custom_scalars`; anything else (a logger that is
    not TensorBoard, a non-zero rank's dummy experiment) is left alone.
    """
    add = getattr(writer, "add_custom_scalars", None)
    if callable(add):
        add(tb_layout())
