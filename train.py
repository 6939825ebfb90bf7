"""Train a GPT under an activation-memory policy and measure it.

python train.py                                   # default: tiny GPT on the embedded corpus, policy none
python train.py policy=selective accum=8
python train.py -m policy=none,full,selective     # Hydra multirun: one folder per sweep
python train.py --cfg job                         # print the composed config
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from pathlib import Path

from trainer.interpreter import lean_imports  # the standard library only: first, so it covers the rest

with lean_imports():
    import hydra
    from omegaconf import DictConfig

    from trainer.core.rundir import discard_run_dir, write_json_atomic
    from trainer.core.schema import describe_user_error, register_configs, validate
    from trainer.errors import RunFailed
    from trainer.measure import metrics

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from trainer.policies import build_policy

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        # The schema's checks and the policy's parameters first: a bad value is refused in a second, before
        # Lightning and datasets load.
        config = validate(cfg)
        build_policy(config.policy)
        with lean_imports():  # Lightning, datasets and the measuring library
            from trainer.core.run import train

        multirun = hydra_cfg.mode == RunMode.MULTIRUN
        with _sweep_gpus(hydra_cfg, config) as gpus:
            if gpus is not None:  # the local parallel launcher on a multi-GPU machine: this job's own GPUs
                logging.getLogger("train").info("job %s trains on GPU(s) %s", hydra_cfg.job.num, gpus)
                config.trainer = dataclasses.replace(config.trainer, devices=gpus)
            summary = train(config, run_dir, keep_refused=multirun)
    except Exception as e:
        if isinstance(e, RunFailed):  # the run started: summary.json records how it ended
            if hydra_cfg.mode == RunMode.MULTIRUN:  # one bad cell must not stop the sweep
                logging.getLogger("train").error("job %s %s", hydra_cfg.job.num, e)
                return None
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)
        line = describe_user_error(e)
        if line is not None and hydra_cfg.mode == RunMode.MULTIRUN:
            # A cell the sweep cannot run (e.g. policy.k above this model's depth): say so in its folder, go on.
            run_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(run_dir / "summary.json", {"status": "error", "error": line})
            logging.getLogger("train").error("job %s refused: %s", hydra_cfg.job.num, line)
            return None
        # Exit here rather than raise: Hydra would wrap a raised error in a report of its own.
        if line is not None:
            discard_run_dir(run_dir)
        _exit_if_user_error(e)
        raise
    return summary.get(metrics.FINAL_VAL_LOSS)  # the objective for Hydra sweepers that optimise


def _sweep_gpus(hydra_cfg: DictConfig, config: object) -> contextlib.AbstractContextManager[list[int] | None]:
    """A multirun job under the joblib launcher takes a free slot of the machine's GPUs (trainer/core/placement.py)."""
    from hydra.types import RunMode

    if hydra_cfg.mode != RunMode.MULTIRUN:
        return contextlib.nullcontext(None)
    import torch

    from trainer.core.placement import job_gpus

    t = config.trainer  # type: ignore[attr-defined]
    launcher = str(hydra_cfg.launcher.get("_target_", "")) if hydra_cfg.get("launcher") else ""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return job_gpus(launcher, t.accelerator, t.devices, Path(hydra_cfg.sweep.dir), gpus)


def _exit_if_user_error(e: Exception) -> None:
    line = describe_user_error(e)
    if line is not None:
        print(f"error: {line}", file=sys.stderr)
        sys.exit(2)


def cli() -> None:
    # Let errors reach us instead of Hydra's multi-line report, so a user mistake prints as one line.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        main()
    except Exception as e:
        _exit_if_user_error(e)
        raise


if __name__ == "__main__":
    cli()
