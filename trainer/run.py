"""One training run: validated config → DataModule + LightningModule (policy applied) → Trainer → run folder.

The run folder (Hydra's output dir) ends up holding:
  .hydra/config.yaml   the resolved config (written by Hydra)
  tb/                  TensorBoard events: scalars per optimizer step, HParams with the run's final figures
  summary.json         the run's figures and status, written atomically
  checkpoints/         last.ckpt
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import DeviceStatsMonitor, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import DictConfig

from callbacks.measure import MeasureCallback
from models.gpt import GPTConfig
from trainer.data import DataError, TextDataModule
from trainer.module import GPTModule
from trainer.policies import PolicyError, build_policy, policy_params
from trainer.schema import Config, ConfigError, validate

log = logging.getLogger(__name__)
# Lightning gives its logger a console handler of its own; under Hydra the root logger already prints and
# writes train.log, so without this every Lightning message appears twice.
if logging.getLogger().hasHandlers():
    logging.getLogger("lightning").handlers.clear()

USER_ERRORS = (ConfigError, PolicyError, DataError)
HYDRA_FILES = {".hydra", "train.log"}  # what Hydra writes into a run folder before our code runs


def preflight(cfg: Config) -> None:
    """Refuse what the device cannot do, before any data is read."""
    cuda = torch.cuda.is_available() and cfg.trainer.accelerator in ("auto", "gpu", "cuda")
    if cfg.precision == "16-mixed" and not cuda:
        raise ConfigError("precision=16-mixed needs a CUDA GPU; use precision=bf16-mixed or 32-true on CPU")
    if cfg.precision.startswith("bf16") and cuda and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"precision={cfg.precision}: this GPU ({torch.cuda.get_device_name()}) has no bf16; "
            "use precision=16-mixed or 32-true"
        )


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def model_config(cfg: Config, vocab_size: int) -> GPTConfig:
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab_size}; "
            "leave it null to take the tokenizer's size"
        )
    values = {f.name: getattr(cfg.model, f.name) for f in fields(GPTConfig)}
    values["vocab_size"] = cfg.model.vocab_size or vocab_size
    return GPTConfig(**values)


def train(cfg: DictConfig | Config, run_dir: Path, callbacks: list[L.Callback] | None = None) -> dict[str, Any]:
    """Train one configuration; returns the summary also written to `run_dir/summary.json`.

    `callbacks` are added to the Trainer's own (tests and tools use them to look inside a run).
    """
    run_dir = Path(run_dir)
    try:  # everything that can refuse the run, before anything is written
        config = cfg if isinstance(cfg, Config) else validate(cfg)
        policy = build_policy(config.policy)
        policy.check(config.model.n_layer, config.model.attention)
        preflight(config)
        L.seed_everything(config.seed, workers=True, verbose=False)
        data = TextDataModule(config.data, seq_len=config.seq_len, batch_size=config.batch_size, seed=config.seed)
        data.prepare_data()
        data.setup("fit")
        module = GPTModule(
            model_config(config, data.vocab_size),
            policy,
            config.optim,
            max_steps=config.trainer.max_steps,
            compile=config.trainer.compile,
        )
    except USER_ERRORS:
        discard_run_dir(run_dir)
        raise
    try:
        return _fit(config, run_dir, data, module, callbacks or [])
    except BaseException as e:
        write_json_atomic(run_dir / "summary.json", {"status": "error", "error": f"{type(e).__name__}: {e}"})
        raise


def discard_run_dir(run_dir: Path) -> None:
    """A run refused before it started leaves nothing behind but Hydra's own files: remove those too."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= HYDRA_FILES:
        shutil.rmtree(run_dir, ignore_errors=True)


def _fit(
    config: Config, run_dir: Path, data: TextDataModule, module: GPTModule, extra: list[L.Callback]
) -> dict[str, Any]:
    measure = MeasureCallback(config.measure.warmup_steps, config.measure.activation_every_n_steps)
    callbacks: list[L.Callback] = [measure, *extra]
    if config.trainer.enable_checkpointing:
        callbacks.append(ModelCheckpoint(dirpath=run_dir / "checkpoints", save_last=True, save_top_k=0))
    if config.measure.device_stats:
        callbacks.append(DeviceStatsMonitor())
    logger = TensorBoardLogger(save_dir=str(run_dir), name="tb", version="", default_hp_metric=False)
    t = config.trainer
    trainer = L.Trainer(
        max_steps=t.max_steps,
        accumulate_grad_batches=config.accum,
        precision=config.precision,
        gradient_clip_val=t.grad_clip or None,
        # Lightning counts validation intervals in micro-batches; the config speaks optimizer steps.
        val_check_interval=t.val_every_n_steps * config.accum,
        check_val_every_n_epoch=None,
        limit_val_batches=t.val_batches,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        accelerator=t.accelerator,
        devices=t.devices,
        strategy=t.strategy,
        num_nodes=t.num_nodes,
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=t.enable_checkpointing,
        enable_progress_bar=t.enable_progress_bar,
        enable_model_summary=False,
        default_root_dir=str(run_dir),
    )
    log.info(
        "policy=%s plan=%s | %s params | %d train / %d val tokens",
        module.policy.cfg.name,
        module.model.activation_plan.describe(),
        f"{module.model.num_parameters():,}",
        data.train_tokens,
        data.val_tokens,
    )
    trainer.fit(module, datamodule=data)
    final = trainer.validate(module, datamodule=data, verbose=False)
    val_loss = final[0].get("val/loss") if final else None

    summary: dict[str, Any] = {
        "status": "completed",
        "policy": module.policy.cfg.name,
        "policy_params": policy_params(module.policy),
        "plan": module.model.activation_plan.describe(),
        "accum": config.accum,
        "precision": config.precision,
        "batch_size": config.batch_size,
        "seq_len": config.seq_len,
        "tokens_per_step": config.tokens_per_step,
        "seed": config.seed,
        "model": {**asdict(module.model_config), "name": config.model.name, "params": module.model.num_parameters()},
        "data": {
            "source": config.data.source,
            "tokenizer": config.data.tokenizer,
            "train_tokens": data.train_tokens,
            "val_tokens": data.val_tokens,
        },
        "device": str(module.device) if module.device.type == "cpu" else torch.cuda.get_device_name(module.device),
        **measure.summary(),
        "final_val_loss": val_loss,
        "final_val_ppl": math.exp(val_loss) if val_loss is not None else None,
    }
    if trainer.is_global_zero:
        write_json_atomic(run_dir / "summary.json", summary)
        logger.log_hyperparams(hparams(config), metrics=hparam_metrics(summary))
        logger.finalize("success")
    return summary


def hparams(config: Config) -> dict[str, Any]:
    """What a sweep varies, flat, for TensorBoard's HParams tab."""
    return {
        "policy": config.policy["name"] if isinstance(config.policy, dict) else config.policy.name,
        "accum": config.accum,
        "batch_size": config.batch_size,
        "seq_len": config.seq_len,
        "precision": config.precision,
        "model": config.model.name,
        "n_layer": config.model.n_layer,
        "n_embd": config.model.n_embd,
        "attention": config.model.attention,
        "dropout": config.model.dropout,
        "seed": config.seed,
    }


def hparam_metrics(summary: dict[str, Any]) -> dict[str, float]:
    keys = (
        "median_step_ms",
        "tokens_per_s",
        "activation_peak_mib",
        "peak_allocated_mib",
        "final_train_loss",
        "final_val_loss",
    )
    return {f"hparams/{k}": float(summary[k]) for k in keys if summary.get(k) is not None}
