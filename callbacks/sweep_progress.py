"""Where a sweep is: "job 3/15 step 40/150" in the console of a Hydra multirun.

Hydra gives each job its number (`hydra.job.num`, from 0) but not the size of the sweep. The sweeper saves the
sweep's own config, with the command-line overrides as typed (`policy=none,full`) and `hydra.sweeper.params`, to
`<sweep dir>/multirun.yaml` before it launches anything; expanding those overrides the way the basic sweeper does
gives the number of jobs. Other sweepers (Optuna, Nevergrad, ...) say it as `n_trials` / `budget`; without one of
these the line reads "job 3" alone.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


def sweep_position() -> tuple[int, int | None, str] | None:
    """(job number from 1, jobs in the sweep or None, this job's overrides) in a Hydra multirun; else None."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
    except ImportError:  # pragma: no cover - hydra is a dependency
        return None
    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    return int(hc.job.num) + 1, sweep_size(hc), str(hc.job.override_dirname or "")


def sweep_size(hc: DictConfig) -> int | None:
    """Jobs in the sweep this job belongs to, or None when it cannot be told."""
    sweep_dir = Path(str(hc.sweep.dir))
    if not sweep_dir.is_absolute():
        sweep_dir = Path(str(hc.runtime.cwd)) / sweep_dir
    saved = sweep_dir / "multirun.yaml"
    try:
        hydra_cfg = OmegaConf.load(saved).hydra if saved.is_file() else hc
    except Exception:  # a half-written or foreign file: no total rather than no job
        hydra_cfg = hc
    sweeper = hydra_cfg.get("sweeper") or {}
    for key in ("n_trials", "budget"):  # optimising sweepers state their size
        if isinstance(sweeper.get(key), int):
            return int(sweeper[key])
    if not str(sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return None
    if not saved.is_file():
        return None  # the job's own hydra config holds this job's overrides, not the sweep's
    return count_basic_sweep(dict(sweeper.get("params") or {}), list(hydra_cfg.overrides.task))


def count_basic_sweep(params: dict[str, Any], arguments: list[str]) -> int | None:
    """How many jobs Hydra's basic sweeper makes of `hydra.sweeper.params` plus command-line overrides."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    lines = [f"{k}={v}" for k, v in params.items()] + [str(a) for a in arguments]
    try:
        overrides = OverridesParser.create().parse_overrides(lines)
        batches = BasicSweeper.split_arguments(overrides, None)
    except Exception:  # glob() sweeps need the config loader; anything odd: no total
        return None
    return sum(len(batch) for batch in batches)


class SweepProgress(L.Callback):
    """Names the job in the progress bar ("job i/n epoch 0: 40%|…") and logs its start and end; without a
    progress bar (trainer.enable_progress_bar=false: log files, SLURM output) also logs "job i/n step s/max"
    every `every_n_steps` optimizer steps (default: a tenth of the run)."""

    def __init__(self, job: int, total: int | None, overrides: str = "", every_n_steps: int | None = None) -> None:
        self.job, self.total, self.overrides = job, total, overrides
        self.every_n_steps = every_n_steps
        self._last_step = -1
        self._bar_epoch = -1

    @property
    def prefix(self) -> str:
        return f"job {self.job}/{self.total}" if self.total else f"job {self.job}"

    def line(self, step: int, max_steps: int) -> str:
        return f"{self.prefix} step {step}/{max_steps}" if max_steps > 0 else f"{self.prefix} step {step}"

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.every_n_steps is None:
            self.every_n_steps = max(1, trainer.max_steps // 10) if trainer.max_steps > 0 else 50
        self._last_step = trainer.global_step  # a resumed run starts past 0
        what = f" ({self.overrides})" if self.overrides else ""
        log.info("%s%s: training for %s steps", self.prefix, what, trainer.max_steps)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        bar = getattr(trainer.progress_bar_callback, "train_progress_bar", None)
        if bar is not None and trainer.current_epoch != self._bar_epoch and hasattr(bar, "set_description"):
            self._bar_epoch = trainer.current_epoch  # the bar writes "Epoch N" at each epoch start; say the job
            bar.set_description(f"{self.prefix} epoch {trainer.current_epoch}", refresh=False)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if trainer.progress_bar_callback is not None:
            return  # the bar shows the step, under the job's name: a log line would break it up
        step = trainer.global_step
        if step == self._last_step:
            return  # still accumulating micro-batches
        self._last_step = step
        assert self.every_n_steps is not None
        if step % self.every_n_steps == 0 or step == trainer.max_steps:
            log.info(self.line(step, trainer.max_steps))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        log.info("%s done at step %d", self.prefix, trainer.global_step)


def sweep_progress(every_n_steps: int | None = None) -> list[L.Callback]:
    """The callbacks to add to a run: a SweepProgress in a Hydra multirun, none otherwise."""
    where = sweep_position()
    if where is None:
        return []
    job, total, overrides = where
    return [SweepProgress(job, total, overrides, every_n_steps)]
