"""THE one assembly path: a validated config → the facts a run resolves from it → the LightningModule and the
DataModule. train.py's run, `trainer.check`, the estimator's session (on fake tensors), the planner's config-level
entry and every benchmark build through here; nothing else constructs either from a config.

    device = build.train_device(config)        the device type Lightning trains on
    hf = build.hf_config(config)                model=hf: its config, read once; what the family lacks refused here
    data = build.data_module(config)            prepared and set up: the tokenizer's vocabulary is known
    module = build.module(config, policy, vocab_size=build.vocab(config, data), hf_config=hf)

The caller seeds torch's RNG before `module` (a run seeds everything, the tools `config.seed`), so each keeps the
initialisation it always had.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer import precision as precision_
from trainer.core.data import TextDataModule
from trainer.core.module import DecoderModule
from trainer.core.schema import Config, model_vocab, vocab_for
from trainer.errors import ConfigError
from trainer.loss import LossConfig
from trainer.policies import Policy, build_policy, needs_attention_seam, no_seam_refusal


def train_device(config: Config) -> str:
    """The device type Lightning will train on (trainer.accelerator=auto takes CUDA where there is one)."""
    cuda = torch.cuda.is_available() and config.trainer.accelerator in ("auto", "gpu", "cuda")
    return "cuda" if cuda else "cpu"


def hf_config(config: Config) -> Any:
    """model=hf: its config, read once (a bad folder or an offline hub id fails here with one line), and what the
    family lacks refused before any data is read: the attention implementation asked for, the seam `selective`
    needs, more positions than it has. None for the native families."""
    if config.model.family != "hf":
        return None
    from models.hf import attn_implementation, has_attention_seam, load_config, max_positions, model_class

    loaded = load_config(str(config.model.name_or_path))
    cls = model_class(loaded)
    attn_implementation(cls, config.model.attention)
    policy = build_policy(config.policy)
    depth = getattr(loaded, "num_hidden_layers", None) or getattr(loaded, "n_layer", None)
    if isinstance(depth, int) and not policy.planned_first and not has_attention_seam(cls):
        policy.check(depth, config.model.attention)
        if needs_attention_seam(policy, depth):
            raise no_seam_refusal(policy, cls.__name__)
    limit = max_positions(loaded)
    if limit is not None and config.seq_len > limit:
        raise ConfigError(
            f"seq_len={config.seq_len} exceeds {config.model.name_or_path}'s {limit} positions; lower seq_len"
        )
    return loaded


def data_module(config: Config) -> TextDataModule:
    """The run's DataModule, its corpus tokenized (cached) and split: `vocab_size` is the tokenizer's."""
    data = TextDataModule(
        config.data,
        seq_len=config.seq_len,
        batch_size=config.batch_size,
        seed=config.seed,
        tokenizer_from=config.model.name_or_path if config.data.tokenizer == "model" else None,
    )
    data.prepare_data()
    data.setup("fit")
    return data


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
    m = DecoderModule(
        config.model,
        policy,
        config.optim,
        max_steps=config.trainer.max_steps,
        compile=config.trainer.compile,
        loss=loss or config.loss,
        vocab_size=vocab_size if vocab_size is not None else model_vocab(config),
        hf_config=hf_config,
    )
    m.fsdp_param_dtype = precision_.fsdp2_param_dtype(precision or config.precision, config.trainer)
    return m
