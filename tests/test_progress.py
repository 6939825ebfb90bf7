"""The console progress bar counts optimizer steps out of trainer.max_steps (callbacks/progress.py), in a real fit
and in the console of a CLI run; validation keeps its own bar; a sweep's bar still says "job i/n"."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest

from callbacks.progress import StepProgressBar
from callbacks.sweep_progress import SweepProgress
from tests.conftest import SMALL, run_cli
from trainer.core.run import train

ACCUM, STEPS = 4, 3
BAR_ON = ["trainer.enable_progress_bar=true", "trainer.enable_checkpointing=false"]


class BarWatch(L.Callback):
    """Reads the progress bars as the user sees them: at each batch's start (a bar as the last batch left it), at
    the end of validation and of training (before the bar's own hooks, which run after this callback's)."""

    def __init__(self) -> None:
        self.train: list[tuple[int, int | None, int]] = []  # (bar n, bar total, global_step)
        self.val: list[tuple[int, int | None]] = []
        self.final: tuple[int, int | None, int] | None = None
        self.description = ""
        self.postfix = ""

    @staticmethod
    def bar(trainer: L.Trainer) -> StepProgressBar:
        callback = trainer.progress_bar_callback
        assert isinstance(callback, StepProgressBar), type(callback)
        return callback

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        tqdm = self.bar(trainer).train_progress_bar
        self.train.append((tqdm.n, tqdm.total, trainer.global_step))

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.state.fn == "fit":
            tqdm = self.bar(trainer).val_progress_bar
            self.val.append((tqdm.n, tqdm.total))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.on_validation_batch_start(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tqdm = self.bar(trainer).train_progress_bar
        self.final = (tqdm.n, tqdm.total, trainer.global_step)
        self.description, self.postfix = tqdm.desc, tqdm.postfix or ""


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> BarWatch:
    """One real fit, accum=4 max_steps=3, validating after step 2: 12 micro-batches, 3 optimizer steps."""
    from hydra import compose, initialize_config_dir

    from tests.conftest import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[*SMALL, *BAR_ON, f"accum={ACCUM}", f"trainer.max_steps={STEPS}", "trainer.val_every_n_steps=2"],
        )
    watch = BarWatch()
    train(cfg, tmp_path_factory.mktemp("bar"), callbacks=[watch])
    return watch


def test_training_bar_advances_once_per_optimizer_step(watched: BarWatch) -> None:
    seen = watched.train
    assert len(seen) == ACCUM * STEPS  # one reading per micro-batch
    assert [n for n, _, _ in seen] == [i // ACCUM for i in range(ACCUM * STEPS)]  # Lightning's own: 0, 1, 2, ...
    assert all(total == STEPS for _, total, _ in seen), seen  # never "?", never micro-batches
    assert all(n == step for n, _, step in seen)
    assert watched.final == (STEPS, STEPS, STEPS)


def test_validation_bar_counts_its_batches(watched: BarWatch) -> None:
    # trainer=smoke: val_batches=2; one validation in the fit (the bar sets its total at its first batch's start)
    assert watched.val[1:] == [(1, 2), (2, 2)], watched.val


def test_bar_reads_steps_without_the_loggers_version(watched: BarWatch) -> None:
    assert watched.description == "Epoch 0: "  # tqdm's separator
    assert "loss=" in watched.postfix and "v_num" not in watched.postfix


def test_sweep_bar_keeps_job_i_of_n(tmp_path: Path, compose_cfg) -> None:
    watch = BarWatch()
    cfg = compose_cfg(*BAR_ON, "accum=2", "trainer.max_steps=2")
    train(cfg, tmp_path, callbacks=[SweepProgress(2, 6, "policy=none"), watch])
    assert watch.description == "job 2/6 epoch 0: "
    assert watch.final == (2, 2, 2)


@pytest.mark.parametrize(
    ("max_steps", "batches", "accum", "total"),
    [(30, 1000, 8, 30), (-1, 10, 4, 3), (-1, 8, 4, 2), (-1, math.inf, 4, None)],
)
def test_bar_total_is_max_steps_else_the_epochs_steps(
    max_steps: int, batches: float, accum: int, total: int | None
) -> None:
    trainer = SimpleNamespace(max_steps=max_steps, num_training_batches=batches, accumulate_grad_batches=accum)
    assert StepProgressBar().steps_total(trainer) == total  # type: ignore[arg-type]


@pytest.mark.slow
def test_cli_console_bar_reads_steps(tmp_path: Path) -> None:
    """What the user reported: `accum=8 trainer.max_steps=3` read 3/3 after three micro-batches, then 4/? … 24/?."""
    r = run_cli(*SMALL, *BAR_ON, "accum=8", "trainer.max_steps=3", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    frames = [f for f in re.split(r"[\r\n]", r.stdout + r.stderr) if f.startswith("Epoch 0")]
    counts = [m.groups() for f in frames if (m := re.search(r"\| (\d+)/(\S+) \[", f))]
    assert counts, (r.stdout + r.stderr)[-2000:]
    assert {total for _, total in counts} == {"3"}, counts
    assert [int(n) for n, _ in counts][-1] == 3 and max(int(n) for n, _ in counts) == 3
    assert all("step/s" in f for f in frames if "/s" in f)
