"""Which GPUs a sweep's job trains on, when the local parallel launcher runs several jobs at once on one machine.

    with claim_gpus(lock_dir, gpus=4, per_job=2) as ids:   # [0, 1], or [2, 3] while another job holds [0, 1]
        ...                                                 # train on Trainer(devices=ids)

The machine's GPUs are split into slots of `per_job` (trainer.devices); a job holds one slot for its whole run by an
exclusive lock on a file per GPU in the sweep's folder (`fcntl.flock`, which the OS releases if the worker dies), and
waits for a free slot when every one is held, so never two jobs on one GPU whatever the launcher's `n_jobs` or the
jobs' sizes.

Near tool: Hydra's submitit_local launcher gives each job its GPUs by starting it in a process of its own with
CUDA_VISIBLE_DEVICES; joblib's workers are long-lived processes whose CUDA an earlier job may have initialised, where
that variable no longer takes effect, so the GPUs are named to Lightning instead (`devices=[ids]`).

Known limitations: one machine (the locks are files); a job of several processes (DDP, FSDP2) is not run inside a
joblib worker at all (Lightning would relaunch the sweep's command), so slots of more than one GPU serve
single-process strategies that use several devices.
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from trainer.errors import ConfigError

POLL_S = 0.5  # how often a job waiting for a slot looks again


@contextlib.contextmanager
def claim_gpus(lock_dir: Path, gpus: int, per_job: int, timeout_s: float | None = None) -> Iterator[list[int]]:
    """Hold a free slot of `per_job` GPUs out of `gpus` until the block ends; their ids. Waits while every slot is
    held (at most `timeout_s`: then TimeoutError)."""
    slots = gpus // per_job
    if slots < 1:
        raise ConfigError(
            f"trainer.devices={per_job} per job and this machine has {gpus} GPU(s); lower trainer.devices"
        )
    lock_dir.mkdir(parents=True, exist_ok=True)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        for slot in range(slots):
            ids = list(range(slot * per_job, (slot + 1) * per_job))
            handles = _lock_all([lock_dir / f"gpu{i}.lock" for i in ids])
            if handles is None:
                continue
            try:
                yield ids
            finally:
                for handle in handles:
                    fcntl.flock(handle, fcntl.LOCK_UN)
                    handle.close()
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"every slot of {per_job} GPU(s) out of {gpus} stayed held for {timeout_s} s")
        time.sleep(POLL_S)


def _lock_all(paths: list[Path]) -> list[IO[str]] | None:
    """Every GPU of a slot locked (a lock per GPU, so jobs of different sizes in one sweep never share one), or none
    held and None."""
    held: list[IO[str]] = []
    for path in paths:
        handle = path.open("a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            for h in held:
                fcntl.flock(h, fcntl.LOCK_UN)
                h.close()
            return None
        held.append(handle)
    return held


def job_gpus(
    launcher: str, accelerator: str, devices: object, sweep_dir: Path, gpu_count: int
) -> contextlib.AbstractContextManager[list[int] | None]:
    """A sweep job's GPUs: under Hydra's joblib launcher (hydra/launcher=parallel) on a machine with more than one
    GPU, a slot of its own of `devices` GPUs (claim_gpus); None elsewhere (Lightning picks, as for a single run)."""
    if "joblib" not in launcher.lower() or accelerator not in ("auto", "gpu", "cuda") or gpu_count <= 1:
        return contextlib.nullcontext(None)
    per_job = devices if isinstance(devices, int) and devices > 0 else 1
    return claim_gpus(sweep_dir / ".gpus", gpu_count, per_job)
