"""THE one assembly path: a validated config → the facts a run resolves from it → the LightningModule and the
DataModule. train.py's run, `trainer.check`, the estimator's session (on fake tensors), the planner's config-level
entry and every benchmark build through here; nothing else constructs either from a config.

    facts = build.resolve(config)               device, precision, HF config, vocabulary, world: settled once
                                                (trainer/core/resolve.py); refusals before any data is read
    data = build.data_module(config)            prepared and set up: the tokenizer's vocabulary is known
    module = build.module(config, policy, vocab_size=build.vocab(config, data), hf_config=facts.hf_config)

The caller seeds torch's RNG before `module` (a run seeds everything, the tools `config.seed`), so each keeps the
initialisation it always had.
"""

from __future__ import annotations

from typing import Any

from trainer import precision as precision_
from trainer.core.data import TextDataModule
from trainer.core.module import DecoderModule
from trainer.core.resolve import Resolved, hf_config, pipeline_parallel, resolve, train_device
from trainer.core.schema import Config, model_vocab, vocab_for
from trainer.loss import LossConfig
from trainer.policies import Policy

__all__ = [
    "Resolved",
    "data_module",
    "data_parallel_ranks",
    "hf_config",
    "module",
    "resolve",
    "train_batch",
    "train_device",
    "vocab",
]


def data_module(config: Config) -> TextDataModule:
    """The run's DataModule, its corpus tokenized (cached) and split: `vocab_size` is the tokenizer's."""
    data = TextDataModule(
        config.data,
        seq_len=config.seq_len,
        batch_size=train_batch(config),
        seed=config.seed,
        tokenizer_from=config.model.name_or_path if config.data.tokenizer == "model" else None,
        val_blocks=config.trainer.val_batches * config.batch_size * data_parallel_ranks(config),
        val_batch_size=config.batch_size if config.trainer.pipeline_parallel > 1 else None,
    )
    data.prepare_data()
    data.setup("fit")
    return data


def train_batch(config: Config) -> int:
    """The train loader's batch: a micro-batch, or under pipeline stages a step's micro-batches as one batch (the
    schedule splits it). Validation reads micro-batches either way."""
    return config.batch_size * (config.accum if config.trainer.pipeline_parallel > 1 else 1)


def data_parallel_ranks(config: Config) -> int:
    """The ranks that read different blocks (a tensor-parallel group, and a pipeline's stages, read the same ones)."""
    t = config.trainer
    devices = t.devices if isinstance(t.devices, int) and t.devices > 0 else 1
    return max(1, devices * t.num_nodes // max(1, t.tensor_parallel * t.pipeline_parallel))


def vocab(config: Config, data: TextDataModule | None = None) -> int:
    """The vocabulary the model is built for: the tokenizer's (data), or without data read, what the config says
    the tokenizer will have (the estimator's and the benchmarks' random batches)."""
    return vocab_for(config, data.vocab_size) if data is not None else model_vocab(config)


def module(
    config: Config,
    policy: Policy | str = "none",
    *,
    vocab_size: int | None = None,
    hf_config: Any = None,
    loss: LossConfig | None = None,
    precision: str | None = None,
) -> DecoderModule:
    """The run's LightningModule: the configured model (any family) with `policy` installed, the loss head
    (`loss`: another than the configured one), AdamW and its schedule. Initialised by the caller's torch RNG.
    `precision`: the settled precision (default config.precision, settled by a run's preflight), which decides
    FSDP2's mixed-precision policy when the module is sharded."""
    args = (config.model, policy, config.optim)
    kwargs: dict[str, Any] = dict(
        max_steps=config.trainer.max_steps,
        compile=config.trainer.compile,
        loss=loss or config.loss,
        vocab_size=vocab_size if vocab_size is not None else model_vocab(config),
        hf_config=hf_config,
    )
    pipeline = pipeline_parallel(config)
    if pipeline is not None:  # the rank's stages, cut at configure_model
        from trainer.core.stages import PipelineModule

        micro = (config.batch_size, config.seq_len)
        return PipelineModule(*args, pipeline=pipeline, micro_batch=micro, grad_clip=config.trainer.grad_clip, **kwargs)
    m = DecoderModule(*args, **kwargs)
    m.fsdp_param_dtype = precision_.fsdp2_param_dtype(precision or config.precision, config.trainer)
    t = config.trainer
    m.sequence_parallel, m.loss_parallel = t.sequence_parallel, t.loss_parallel
    if t.tensor_parallel > 1:  # what the degree must divide in this model, before a process group exists
        from trainer.parallel import tensor

        tensor.check(m.adapter, t.tensor_parallel, sequence_parallel=t.sequence_parallel, seq_len=config.seq_len)
    return m
