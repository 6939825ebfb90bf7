"""One training run: validated config → DataModule + LightningModule (policy applied) → Trainer → run folder.

The run folder (Hydra's output dir) ends up holding:
  .hydra/config.yaml   the resolved config (written by Hydra)
  events.out.tfevents.*  TensorBoard events, in the run folder itself (TensorBoard names the run after it): scalars
                       per optimizer step, HParams with the run's final figures
  summary.json         the run's figures and status (completed | oom | error), written atomically
  checkpoints/         last.ckpt and the newest periodic ones

A run that fails after it started still writes summary.json, with `status` and what it reached, then raises
`RunFailed`; train.py turns that into one line (single run) or lets the sweep go on (multirun).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import DeviceStatsMonitor, ModelCheckpoint
from omegaconf import DictConfig

from callbacks.guards import NonFiniteError, NumericGuard
from callbacks.measure import MeasureCallback
from callbacks.prediction import PredictionCallback
from callbacks.progress import StepProgressBar
from callbacks.snapshot import MemorySnapshot
from callbacks.sweep_progress import sweep_progress
from callbacks.tb_logger import JobTensorBoardLogger, micro, write_tb_layout
from trainer import precision
from trainer.core import build
from trainer.core.data import TextDataModule
from trainer.core.module import DecoderModule
from trainer.core.rundir import discard_run_dir, write_json_atomic
from trainer.core.schema import Config, ConfigError, TrainerConfig, validate
from trainer.errors import RunFailed, UserError
from trainer.formatting import MIB, one_line
from trainer.measure import metrics
from trainer.policies import build_policy, policy_params

log = logging.getLogger(__name__)
# Lightning gives its logger a console handler of its own; under Hydra the root logger already prints and
# writes train.log, so without this every Lightning message appears twice.
if logging.getLogger().hasHandlers():
    logging.getLogger("lightning").handlers.clear()


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
    )


def preflight(cfg: Config, run_dir: Path) -> tuple[build.Resolved, Path | None]:
    """Refuse what the device, the folder or the checkpoint cannot do, before any data is read; settle
    `precision=auto` (cfg.precision becomes what will run; one line says why).

    Returns the configuration's facts, settled once (`build.resolve`: device, precision, HF config, ...), and the
    checkpoint to resume from, already proven loadable."""
    facts = build.resolve(cfg)
    device, chosen = facts.device, facts.precision
    if cfg.precision == "auto":
        log.info(facts.why)
    cfg.precision = chosen
    warning = precision.emulation_warning(chosen, device)
    if warning:
        log.warning(warning)
    if not os.access(run_dir if run_dir.exists() else run_dir.parent, os.W_OK):
        raise ConfigError(f"cannot write to the run folder {run_dir}; pass hydra.run.dir=<a writable folder>")
    probe_trainer(cfg)
    resume = checkpoint_file(cfg.ckpt_path, run_dir, cfg) if cfg.ckpt_path else None
    return facts, resume


def probe_trainer(cfg: Config) -> None:
    """Let Lightning refuse its own arguments (trainer.devices=0, an accelerator this machine lacks, ...) before any
    data is read, as one line: a throwaway Trainer with the run's device arguments and nothing else."""
    t = cfg.trainer
    try:
        L.Trainer(
            accelerator=t.accelerator,
            devices=t.devices,
            strategy=lightning_strategy(t),
            num_nodes=t.num_nodes,
            precision=precision.lightning_precision(cfg.precision, t),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
    except Exception as e:
        if type(e).__name__ != "MisconfigurationException":
            raise
        reason = one_line(e).replace("`", "").rstrip(".")
        raise ConfigError(f"trainer: Lightning refuses it: {reason}; see conf/trainer/ for the options") from None


def checkpoint_file(ckpt_path: str, run_dir: Path, cfg: Config | None = None) -> Path:
    """Resolve `ckpt_path` and prove it is a Lightning checkpoint that loads with weights_only, written by the layout
    that resumes it (pipeline stages write the whole model's names and each rank's RNG) on batches of the same rows,
    in one line."""
    path = run_dir / "checkpoints" / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path)
    if not path.is_file():
        hint = (
            " (ckpt_path=last resumes the run folder given by hydra.run.dir=<run folder>)"
            if ckpt_path == "last"
            else ""
        )
        raise ConfigError(f"ckpt_path={ckpt_path}: no checkpoint at {path}{hint}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise ConfigError(f"ckpt_path={ckpt_path}: {path} is not a readable checkpoint ({one_line(e, 160)})") from None
    if not isinstance(state, dict) or "state_dict" not in state or "optimizer_states" not in state:
        raise ConfigError(f"ckpt_path={ckpt_path}: {path} is not a Lightning training checkpoint of this project")
    if cfg is None:
        return path
    stages = cfg.trainer.pipeline_parallel
    written = len((state.get("rng_state") or {}).get("ranks") or [None])  # stages keep one RNG state a rank
    if written != stages:
        raise ConfigError(
            f"ckpt_path={ckpt_path}: {path} was written with trainer.pipeline_parallel={written}; resume it with the "
            "same trainer.pipeline_parallel (each rank's RNG and optimizer state are kept for that layout)"
        )
    loaders = state.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader") or [{}]
    rows, now = loaders[0].get("batch_size"), build.train_batch(cfg)
    # Stages only: elsewhere the loader itself refuses other rows at load (policy=auto may halve the micro-batch)
    if stages > 1 and rows is not None and rows != now:
        raise ConfigError(
            f"ckpt_path={ckpt_path}: {path} was trained on batches of {rows} rows, this run's have {now}: resume with "
            "the same batch_size × accum (pipeline stages take a step's micro-batches as one batch)"
        )
    return path


def check_same_model(ckpt_path: str, path: Path, module: DecoderModule) -> None:
    """The checkpoint holds this model's weights (under pipeline stages, the whole model's), or one line, before any
    rank starts: a rank whose keys are missing would otherwise fail alone."""
    have = set(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["state_dict"])
    want = set(module.state_dict())
    if have != want:
        odd = sorted(want - have) or sorted(have - want)
        raise ConfigError(
            f"ckpt_path={ckpt_path}: {path} holds another model's weights ({odd[0]} is in one and not the other); "
            "resume with the model configuration it was trained with"
        )


@contextlib.contextmanager
def host_memory_limit(mib: int | None) -> Iterator[None]:
    """Cap the process's data segment so that an allocation past `mib` fails, as a GPU's does past its memory."""
    if mib is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    held = _data_segment_bytes()
    if mib * MIB <= held:
        raise ConfigError(
            f"trainer.host_memory_limit_mib={mib} is below what the process already holds ({held // MIB} MiB); "
            f"raise it above {held // MIB + 1}"
        )
    resource.setrlimit(resource.RLIMIT_DATA, (mib * MIB, hard))
    try:
        yield
    finally:  # later jobs of a sweep run in this same process
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _data_segment_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def lightning_strategy(t: TrainerConfig, layer_class: type | None = None) -> Any:
    """Config names → Lightning strategies; the two FSDP flavours and pipeline stages need objects, not strings."""
    name = t.strategy
    if t.pipeline_parallel > 1:
        from trainer.core.stages import PipelineStrategy

        return PipelineStrategy(t.pipeline_parallel, t.devices // t.pipeline_parallel)
    if name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        if not isinstance(t.devices, int) or t.devices < 1:
            raise ConfigError(f"trainer.strategy=fsdp2 needs a device count, e.g. trainer.devices=2 (got {t.devices})")
        # Explicit sizes (its "auto" puts every device of a node into tensor parallelism): FSDP2 over the devices a
        # tensor-parallel group does not take, one 2-D mesh ("data_parallel", "tensor_parallel").
        tp = t.tensor_parallel
        return ModelParallelStrategy(
            data_parallel_size=t.devices * t.num_nodes // tp, tensor_parallel_size=tp, save_distributed_checkpoint=False
        )
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        # Each decoder layer a unit. No activation_checkpointing_policy: the project's policy already runs inside.
        return FSDPStrategy(auto_wrap_policy={layer_class} if layer_class else None)
    return name


def even_threads(t: TrainerConfig) -> None:
    """One thread count on every rank of a run on several processes: Lightning's own setting (cores // processes,
    kept where the user set OMP_NUM_THREADS), applied before the Trainer launches the other ranks, so they inherit it.

    Lightning applies it itself, but in the launching process alone and after the others have started with torch's
    default, and a CPU kernel's reduction order depends on its thread count: ranks computing the same replicated
    tensor (the norms without sequence parallelism) would round differently and their replicas drift apart."""
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed  # private: no public name

    processes = t.devices if isinstance(t.devices, int) else 1
    if processes > 1:
        _set_num_threads_if_needed(num_processes=processes)


def train(
    cfg: DictConfig | Config, run_dir: Path, callbacks: list[L.Callback] | None = None, keep_refused: bool = False
) -> dict[str, Any]:
    """Train one configuration; returns the summary also written to `run_dir/summary.json`.

    `callbacks` are added to the Trainer's own (tests and tools use them to look inside a run). A refused run
    (one-line error) leaves no folder behind, unless `keep_refused` (a sweep's cell keeps its .hydra and log,
    and records the refusal beside them).
    """
    run_dir = Path(run_dir)
    try:  # everything that can refuse the run, before anything is written
        config = cfg if isinstance(cfg, Config) else validate(cfg)
        policy = build_policy(config.policy)
        if config.model.family != "hf":
            policy.check(config.model.n_layer, config.model.attention)
        facts, resume_from = preflight(config, run_dir)
        L.seed_everything(config.seed, workers=True, verbose=False)
        data = build.data_module(config)
        module = build.module(config, policy, vocab_size=build.vocab(config, data), hf_config=facts.hf_config)
        if resume_from is not None:
            check_same_model(str(config.ckpt_path), resume_from, module)
        run = Run(config, run_dir, data, module, callbacks or [])
        return run.fit(resume_from)  # policy=auto may still refuse here, at fit start, before a step is taken
    except UserError:
        if not keep_refused:
            discard_run_dir(run_dir)
        raise


class Run:
    """The Trainer and its callbacks for one configuration, and the summary they produce."""

    def __init__(
        self, config: Config, run_dir: Path, data: TextDataModule, module: DecoderModule, extra: list[L.Callback]
    ) -> None:
        self.config, self.run_dir, self.data, self.module = config, run_dir, data, module
        t = config.trainer
        self.measure = MeasureCallback(
            config.measure.warmup_steps, config.measure.activation_every_n_steps, max_steps=t.max_steps
        )
        self.guard = NumericGuard(t.on_nonfinite)
        # What the policy brings (auto: its planner, at fit start from a profile of the real batch); after `measure`,
        # so it sees each step.
        self.policy_callbacks: list[L.Callback] = module.policy.callbacks(config)
        # The run's own prediction, after the policy's callbacks (auto's plan is chosen by then).
        self.prediction = PredictionCallback(config) if config.measure.predict else None
        callbacks: list[L.Callback] = [self.measure, self.guard, *self.policy_callbacks]
        callbacks += [*([self.prediction] if self.prediction else []), *extra]
        callbacks += sweep_progress()  # "job i/n step s/max" in a Hydra multirun; [] otherwise
        m = config.measure
        if m.snapshot_step is not None or m.snapshot_on_oom:
            callbacks.append(MemorySnapshot(m.snapshot_step, m.snapshot_on_oom, run_dir))
        if t.enable_checkpointing:
            callbacks.append(
                ModelCheckpoint(
                    dirpath=run_dir / "checkpoints",
                    filename="step{step:06d}",
                    auto_insert_metric_name=False,
                    every_n_train_steps=t.checkpoint_every_n_steps,
                    monitor="step",  # "newest" is the order that keeps the latest periodic checkpoints
                    mode="max",
                    save_top_k=t.keep_checkpoints,
                    save_last=True,
                )
            )
        if config.measure.device_stats:
            callbacks.append(DeviceStatsMonitor())
        if t.enable_progress_bar:
            callbacks.append(StepProgressBar())  # counts optimizer steps out of max_steps, not micro-batches
        # Events in the run folder itself: `tensorboard --logdir <sweep>` names each run by its job.
        self.logger = JobTensorBoardLogger(run_dir)
        write_tb_layout(self.logger.experiment, build.train_device(config))  # Custom Scalars for this device
        even_threads(t)
        # Pipeline stages take a step's micro-batches as one batch and step under manual optimization (the schedule
        # runs the backward): no accumulation or clipping by Lightning, the module clips.
        batches_a_step = 1 if t.pipeline_parallel > 1 else config.accum
        self.trainer = L.Trainer(
            max_steps=t.max_steps,
            accumulate_grad_batches=batches_a_step,
            # FSDP2's mixed-precision policy casts for itself: Lightning then runs without autocast
            precision=precision.lightning_precision(config.precision, t),
            gradient_clip_val=(t.grad_clip or None) if t.pipeline_parallel == 1 else None,
            # Lightning counts validation intervals in batches; the config speaks optimizer steps.
            val_check_interval=t.val_every_n_steps * batches_a_step,
            check_val_every_n_epoch=None,
            limit_val_batches=t.val_batches,
            num_sanity_val_steps=0,
            log_every_n_steps=1,
            accelerator=t.accelerator,
            devices=t.devices,
            strategy=lightning_strategy(t, type(module.adapter.layers[0])),
            # The DataModule shards by data-parallel rank itself (trainer/core/data.py: ResumableRandomSampler), so
            # a resumed run of several ranks skips what it trained on; a pipeline's stages read the same rows.
            use_distributed_sampler=False,
            num_nodes=t.num_nodes,
            logger=self.logger,
            callbacks=callbacks,
            enable_checkpointing=t.enable_checkpointing,
            enable_progress_bar=t.enable_progress_bar,
            enable_model_summary=False,
            default_root_dir=str(run_dir),
        )

    def fit(self, resume_from: Path | None = None) -> dict[str, Any]:
        config, module, data = self.config, self.module, self.data
        vocab = module.adapter.head.weight.shape[0]
        if data.vocab_size > vocab:
            raise ConfigError(
                f"the tokenizer's {data.vocab_size} ids do not fit {config.model.name}'s vocabulary of {vocab}; "
                "use data.tokenizer=model or a smaller data.bpe_vocab_size"
            )
        log.info(
            "%s", data.describe(config.tokens_per_step * build.data_parallel_ranks(config), config.trainer.max_steps)
        )
        log.info(
            "model=%s attention=%s policy=%s plan=%s loss=%s precision=%s | %s params | %s train / %d val tokens",
            config.model.name,
            module.adapter.attention,
            module.policy.cfg.name,
            "chosen at fit start" if module.policy.caps.planned_first else module.plan_described(),
            config.loss.name,
            precision.describe(config.precision, config.trainer),
            f"{module.adapter.num_parameters():,}",
            "streamed" if data.train_tokens is None else data.train_tokens,
            data.val_tokens,
        )
        ckpt = str(resume_from) if resume_from else None
        try:
            with host_memory_limit(config.trainer.host_memory_limit_mib):
                self.trainer.fit(module, datamodule=data, ckpt_path=ckpt, weights_only=True if ckpt else None)
                final = self.trainer.validate(module, datamodule=data, verbose=False)
        except UserError:
            raise
        except BaseException as e:
            status = "oom" if is_out_of_memory(e) else "error"
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                status = "interrupted"
            reason = one_line(e) if isinstance(e, NonFiniteError) else f"{type(e).__name__}: {one_line(e)}"
            summary = self.measured()
            self._finish({**self.identity(), "status": status, "error": reason, **summary})
            if status == "interrupted":
                raise
            raise RunFailed(status, f"{status} at step {self.trainer.global_step}: {reason}") from e
        val_loss = final[0].get(metrics.VAL_LOSS) if final else None
        ranks = self.per_rank()
        return self._finish(
            {
                **self.identity(),
                "status": "completed",
                **self.measured(),
                metrics.FINAL_VAL_LOSS: val_loss,
                metrics.FINAL_VAL_PPL: math.exp(val_loss) if val_loss is not None else None,
                "skipped_steps": self.guard.skipped_steps,
                **({"per_rank": ranks} if ranks else {}),
            }
        )

    def measured(self) -> dict[str, Any]:
        """The measuring callback's figures, the policy's callbacks' and the run's own prediction beside them."""
        figures = {**self.measure.summary(), **self.policy_summary()}
        return figures | (self.prediction.summary(figures) if self.prediction else {})

    def policy_summary(self) -> dict[str, Any]:
        """What the policy's callbacks add to summary.json (auto: its plan, predicted beside measured)."""
        out: dict[str, Any] = {}
        for c in self.policy_callbacks:
            out |= c.summary() if hasattr(c, "summary") else {}
        return out

    def identity(self) -> dict[str, Any]:
        """What this run is: the fields a report groups and sorts by."""
        c, m = self.config, self.module
        device = m.device
        return {
            "policy": m.policy.cfg.name,
            "policy_params": policy_params(m.policy),
            "plan": m.plan_described(),
            "loss": asdict(c.loss),
            "accum": c.accum,
            "precision": c.precision,
            "batch_size": c.batch_size,
            "seq_len": c.seq_len,
            "tokens_per_step": c.tokens_per_step,
            "seed": c.seed,
            "model": {"name": c.model.name, **m.model_described()},
            "data": {
                "source": c.data.source,
                "tokenizer": c.data.tokenizer,
                "streaming": self.data.streaming,
                "train_tokens": self.data.train_tokens,
                "val_tokens": self.data.val_tokens,
            },
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
            "world_size": self.trainer.world_size,
            "resumed_from": c.ckpt_path,
        }

    def per_rank(self) -> list[dict[str, float]]:
        """Each rank's activation peak and whole-step peak, its own prediction of each, and a checksum of its
        parameters (data parallel keeps them equal)."""
        trainer = self.trainer
        if trainer.world_size == 1:
            return []
        measured = self.measure.summary()
        act, total = measured[metrics.ACTIVATION_PEAK_KEY], measured.get(metrics.PEAK_TOTAL_KEY)
        with torch.no_grad():
            # Full tensors under FSDP2 (DTensor shards are gathered), plain ones under DDP.
            params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in self.module.parameters()]
            checksum = sum(float(p.double().sum()) for p in params)
        # NaN crosses the all-gather for "not measured" (a run shorter than the tracked step); it is null in JSON.
        own = self.prediction.predicted if self.prediction else {}
        keys = (
            metrics.ACTIVATION_PEAK_KEY,
            metrics.PREDICTED_ACTIVATION_PEAK_KEY,
            metrics.PEAK_TOTAL_KEY,
            metrics.PREDICTED_PEAK_TOTAL_KEY,
            "param_checksum",
        )
        figures = [
            act,
            own.get(metrics.PREDICTED_ACTIVATION_PEAK_KEY),
            total,
            own.get(metrics.PREDICTED_PEAK_TOTAL_KEY),
            checksum,
        ]
        values = [math.nan if v is None else v for v in figures]
        gathered = trainer.strategy.all_gather(torch.tensor(values, dtype=torch.float64, device=self.module.device))
        return [
            {"rank": r, **{k: None if math.isnan(v) else float(v) for k, v in zip(keys, row, strict=True)}}
            for r, row in enumerate(gathered.cpu().tolist())
        ]

    def _finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """summary.json and the HParams entry, once (rank 0)."""
        if self.trainer.is_global_zero:
            write_json_atomic(self.run_dir / "summary.json", summary)
            model = self.module.model_described()
            self.logger.log_hyperparams(hparams(self.config, summary["status"], model), metrics=hparam_metrics(summary))
            self.logger.finalize("success" if summary["status"] == "completed" else "failed")
        return summary


def hparams(config: Config, status: str, model: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a sweep varies, flat, for TensorBoard's HParams tab: the columns a sweep compares first (policy, loss,
    accum, micro-batch, precision, model; metrics.HPARAM_ORDER), then `micro` (batch_size x accum in one column:
    TensorBoard ticks five hparams, callbacks/tb_logger.py), status (failed jobs stay in the table), then the shape.
    `model`: the built model's `describe()` (an HF model's shape comes from its config)."""
    m = config.model
    shape = model or {"n_layer": m.n_layer, "n_embd": m.n_embd}
    values = {
        "policy": config.policy["name"] if isinstance(config.policy, dict) else config.policy.name,
        "loss": config.loss.name,
        "accum": config.accum,
        "batch_size": config.batch_size,
        "precision": config.precision,
        "model": m.name,
        "micro": micro(config.batch_size, config.accum),
        "status": status,
        "seq_len": config.seq_len,
        "n_layer": shape.get("n_layer"),
        "n_embd": shape.get("n_embd"),
        "attention": m.attention,
        "dropout": m.dropout if m.dropout is not None else "config",
        "seed": config.seed,
    }
    return {k: values[k] for k in metrics.HPARAM_ORDER} | values


# The HParams tab ticks its first five metric columns: the figures a sweep compares (memory, time, quality) first.
HPARAM_METRICS_FIRST = (
    metrics.ACTIVATION_PEAK_KEY,
    metrics.PEAK_TOTAL_KEY,
    metrics.MEDIAN_STEP_MS,
    metrics.TOKENS_PER_S_KEY,
    metrics.FINAL_VAL_LOSS,
)


def hparam_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """Every key on every job, NaN where a figure was not measured: TensorBoard takes the HParams columns from the
    first job it reads, and a job with no metrics would get no HParams entry at all (an early OOM). Column order:
    HPARAM_METRICS_FIRST, then the rest of metrics.SUMMARY_FIGURES."""
    keys = (*HPARAM_METRICS_FIRST, *(k for k in metrics.SUMMARY_FIGURES if k not in HPARAM_METRICS_FIRST))
    return {metrics.hparam_tag(k): float(summary[k]) if summary.get(k) is not None else math.nan for k in keys}
