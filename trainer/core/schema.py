"""Structured-config schema: every knob typed, every bad value refused before any work starts.

Hydra merges conf/ onto these dataclasses, so a wrong type (`accum=abc`) or an unknown key fails at compose time;
`validate()` turns the composed config into objects, which runs each `__post_init__` range check. Kept free of
Lightning and datasets imports so a bad command line fails in a second.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from models import FAMILIES
from trainer import CONF
from trainer.errors import ConfigError, UserError
from trainer.loss import LossConfig
from trainer.precision import PRECISIONS


@dataclass
class ModelConfig:
    """One node for every family (models/): the shape fields the native decoders share, the LLaMA-only ones, and
    the Hugging Face ones. A family ignores the fields it has no use for."""

    name: str = "tiny"
    family: str = "gpt"  # gpt (models/gpt.py) | llama (models/llama.py) | hf (a Hugging Face causal LM)
    vocab_size: int | None = None  # None: take it from the tokenizer (an HF model keeps its own)
    block_size: int = 256  # longest context (HF: from its config.json)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    n_kv_head: int | None = None  # llama: grouped-query attention's key/value heads; None = n_head
    mlp_hidden: int | None = None  # llama: SwiGLU hidden size; None = LLaMA's rule from n_embd
    dropout: float | None = 0.1  # hf: None keeps the config's probabilities
    bias: bool = True  # gpt only (LLaMA has none)
    # eager (T×T scores kept: what `selective` drops) | sdpa (fused kernel) | None (hf only: what transformers
    # picks when none is named, SDPA where the family has it and its eager attention elsewhere; settled here)
    attention: str | None = "eager"
    tie_embeddings: bool = True  # lm_head shares the token embedding
    norm_eps: float = 1e-5  # llama
    rope_theta: float = 10000.0  # llama
    rope: str = "half"  # llama: half (HF's) | complex (torchtitan's to 0.2: fp32 complex channel pairs)
    repeat_kv: bool = False  # llama: keys/values copied to every query head before SDPA (torchtitan's to 0.2)
    name_or_path: str | None = None  # hf: a hub id or a local folder with config.json
    pretrained: bool = False  # hf: load its weights (true) or initialise from the config (false)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model.family={self.family!r}; choose one of: {', '.join(FAMILIES)}")
        if self.attention not in ("eager", "sdpa") and not (self.attention is None and self.family == "hf"):
            named = "'eager' or 'sdpa'" + (" (or null: the best the model has)" if self.family == "hf" else "")
            raise ValueError(f"model.attention={self.attention!r} must be {named}")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        check = FAMILIES[self.family].check
        if check is not None:
            check(self)  # the family's own checks (n_head ÷ n_kv_head, a folder for model=hf, ...)


@dataclass
class DataConfig:
    source: str = "embedded"  # embedded | local | hub
    # local: files, folders (every non-hidden regular file, recursively) or globs ("**" allowed)
    path: list[str] = field(default_factory=list)
    # local: auto (from the names) | text | json (JSON Lines) | parquet | arrow (a save_to_disk folder) | tokens
    format: str = "auto"
    name: str | None = None  # hub: dataset name, e.g. "wikitext"
    config_name: str | None = None  # hub: e.g. "wikitext-103-raw-v1"
    split: str = "train"  # hub (or a saved DatasetDict) split to read
    text_field: str = "text"  # the column holding the text (hub, JSON Lines, Parquet, saved datasets)
    # tokenize and pack while training, split across ranks, position checkpointed; null: true for hub sources
    streaming: bool | None = None
    max_tokens: int | None = None  # stop the train split at this many tokens (streamed: per epoch, over all ranks)
    tokenizer: str = "byte"  # byte (vocab 256) | bpe (trained on a sample of the train split, cached) | model (hf's)
    bpe_vocab_size: int = 4096
    bpe_sample_chars: int = 10_000_000  # characters of the train split the BPE vocabulary is trained on
    vocab_size: int | None = None  # format=tokens: the vocabulary the ids come from (else the model tokenizer's)
    token_dtype: str | None = None  # format=tokens, a flat .bin: its ids' type (nanoGPT writes uint16)
    val_fraction: float = 0.05
    cache_dir: str | None = None  # None: $CKPTLAB_CACHE or ~/.cache/ckptlab/data
    num_workers: int = 0


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4  # cosine decays to this at trainer.max_steps
    warmup_steps: int = 20  # linear warm-up, in optimizer steps
    weight_decay: float = 0.1  # on matmul weights only; norms, biases and embeddings get none
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"optim.lr={self.lr}, optim.min_lr={self.min_lr}: need 0 ≤ min_lr ≤ lr and lr > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps={self.warmup_steps} must be ≥ 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas={self.betas} must be two numbers in [0, 1)")


@dataclass
class TrainerConfig:
    name: str = "default"
    max_steps: int = 150  # optimizer steps (each = `accum` micro-batches)
    val_every_n_steps: int = 50  # optimizer steps between validations
    val_batches: int = 8  # batches per validation
    grad_clip: float = 1.0  # clip the global grad norm; 0 disables
    accelerator: str = "auto"
    devices: Any = 1
    strategy: str = "auto"
    # precision=bf16-mixed under strategy=fsdp2: `fsdp2` is FSDP2's MixedPrecisionPolicy as torchtitan sets it (bf16
    # parameters for compute and all-gathers, fp32 gradient reduce-scatter, fp32 sharded master weights and AdamW
    # state); `autocast` is Lightning's autocast over fp32 shards (fp32 all-gathers). Other strategies autocast.
    mixed_precision: str = "fsdp2"
    num_nodes: int = 1
    # Megatron's tensor parallelism over this many of the devices (trainer=fsdp2: FSDP2 shards over the rest, one 2-D
    # mesh); sequence parallelism also shards the norms and the residual stream by sequence, as torchtitan runs it.
    tensor_parallel: int = 1
    sequence_parallel: bool = True
    # torchtitan's loss parallelism: the head's logits stay split by vocabulary through the cross-entropy (torch's
    # loss_parallel), where a plan splits the head so; off, they are gathered whole on every rank first.
    loss_parallel: bool = True
    # Pipeline stages (torch.distributed.pipelining): the layers cut into this many consecutive stages, one a device
    # (pipeline_virtual a device under interleaved_1f1b), pipeline_schedule running `accum` micro-batches a step.
    # Trained by train.py (trainer/core/stages.py), estimated per rank (python -m trainer.estimate); trainer.devices a
    # multiple of it replicates the pipeline (data parallelism).
    pipeline_parallel: int = 1
    pipeline_schedule: str = "1f1b"  # 1f1b | interleaved_1f1b | gpipe
    pipeline_virtual: int = 1
    compile: bool = False  # torch.compile the model (after the policy is applied)
    enable_progress_bar: bool = True
    enable_checkpointing: bool = True
    checkpoint_every_n_steps: int = 50  # periodic checkpoints (plus last.ckpt) in <run>/checkpoints
    keep_checkpoints: int = 2  # periodic checkpoints kept, newest first
    on_nonfinite: str = "stop"  # a NaN/inf loss or gradient norm: stop (keep the last good checkpoint) | skip the step
    # CPU stand-in for a GPU's memory size: caps the process's data segment (RLIMIT_DATA) while training, so an
    # allocation past it fails like a CUDA OOM. null: no cap.
    host_memory_limit_mib: int | None = None

    def __post_init__(self) -> None:
        if self.mixed_precision not in ("fsdp2", "autocast"):
            raise ValueError(f"trainer.mixed_precision={self.mixed_precision!r}; choose fsdp2 or autocast")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"trainer.on_nonfinite={self.on_nonfinite!r}; choose stop or skip")
        if self.host_memory_limit_mib is not None and self.host_memory_limit_mib < 1:
            raise ValueError(f"trainer.host_memory_limit_mib={self.host_memory_limit_mib} must be ≥ 1 (or null)")
        for key in (
            "max_steps",
            "val_every_n_steps",
            "val_batches",
            "num_nodes",
            "tensor_parallel",
            "pipeline_parallel",
            "pipeline_virtual",
            "checkpoint_every_n_steps",
            "keep_checkpoints",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"trainer.{key}={getattr(self, key)} must be ≥ 1")
        if self.grad_clip < 0:
            raise ValueError(f"trainer.grad_clip={self.grad_clip} must be ≥ 0 (0 disables clipping)")


@dataclass
class MeasureConfig:
    warmup_steps: int = 3  # first optimizer steps left out of the summary (allocator, caches, lazy init)
    # Optimizer steps between live-tensor tracking of one micro-batch (Python per op: too slow for every step;
    # tracked steps are left out of the time figures). 0 disables the tracker.
    activation_every_n_steps: int = 25
    device_stats: bool = False  # also add Lightning's DeviceStatsMonitor (every allocator stat, verbose)
    # Record optimizer step k: a CUDA allocator snapshot for pytorch.org/memory_viz, or on CPU the live-tensor
    # timeline (JSON + PNG). null: off.
    snapshot_step: int | None = None
    snapshot_on_oom: bool = False  # CUDA: record allocator history from fit start; dump it if the run dies of OOM
    # At fit start, the estimator's prediction of this run's peaks (fake tensors, seconds for the models a run
    # trains), written beside the measured ones in summary.json with the signed error of each
    predict: bool = True

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.activation_every_n_steps < 0:
            raise ValueError("measure.warmup_steps and measure.activation_every_n_steps must be ≥ 0")
        if self.snapshot_step is not None and self.snapshot_step < 0:
            raise ValueError(f"measure.snapshot_step={self.snapshot_step} must be ≥ 0 (or null)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    # Validated by trainer.policies.build_policy: each policy has its own parameters.
    policy: Any = field(default_factory=lambda: {"name": "none"})
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    accum: int = 1  # micro-batches per optimizer step (Lightning's accumulate_grad_batches)
    # auto: bf16-mixed where bf16 is native (CUDA with bf16, a CPU with AVX512-BF16/AMX), else 32-true
    precision: str = "auto"
    seed: int = 1337
    batch_size: int = 4  # micro-batch size, in sequences
    seq_len: int = 256  # tokens per sequence; ≤ model.block_size
    # Resume: "last" (this run folder's checkpoints/last.ckpt; pass hydra.run.dir=<the run folder>) or a .ckpt path.
    ckpt_path: str | None = None

    def __post_init__(self) -> None:
        if self.accum < 1:
            raise ValueError(f"accum={self.accum} must be ≥ 1 (micro-batches per optimizer step)")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be ≥ 1")
        if self.seq_len < 1:
            raise ValueError(f"seq_len={self.seq_len} must be ≥ 1")
        if self.model.family != "hf" and self.seq_len > self.model.block_size:  # hf: checked once its config is read
            raise ValueError(
                f"seq_len={self.seq_len} exceeds model.block_size={self.model.block_size}; "
                f"lower seq_len or raise model.block_size"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}; choose one of: {', '.join(PRECISIONS)}")
        if self.model.rope == "complex" and self.precision.endswith("-true") and self.precision != "32-true":
            # the module's cast to 16 bits (Lightning's convert_module) would keep only the complex table's real part
            raise ValueError(
                f"model.rope=complex with precision={self.precision}: the 16-bit cast would drop the rotary table's "
                "imaginary part; use precision=bf16-mixed, as torchtitan trains it"
            )
        snap, steps = self.measure.snapshot_step, self.trainer.max_steps
        if snap is not None and steps > 0 and snap >= steps:  # steps count from 0
            raise ValueError(
                f"measure.snapshot_step={snap} is never reached by trainer.max_steps={steps} (steps 0 to {steps - 1}); "
                f"give measure.snapshot_step ≤ {steps - 1}"
            )
        tokens = self.batch_size * self.seq_len
        if self.loss.name != "standard" and self.loss.chunk_tokens is not None and self.loss.chunk_tokens > tokens:
            raise ValueError(
                f"loss.chunk_tokens={self.loss.chunk_tokens} is larger than the micro-batch's {tokens} tokens "
                f"(batch_size × seq_len); give loss.chunk_tokens ≤ {tokens}"
            )

    @property
    def tokens_per_step(self) -> int:
        return self.accum * self.batch_size * self.seq_len


def register_configs() -> None:
    """Make conf/config.yaml's `- schema` default resolve to the dataclass, so Hydra type-checks overrides, and each
    conf/policy/<name>.yaml's `- /policy_schema/<name>` to its policy's Config (every parameter overridable, no
    default repeated in yaml)."""
    from trainer.policies import POLICIES, config_node

    store = ConfigStore.instance()
    store.store(name="schema", node=Config)
    for name, cls in POLICIES.items():
        store.store(group="policy_schema", name=name, node=config_node(cls))


def validate(cfg: DictConfig) -> Config:
    """Composed config → typed objects, running every range check; raises ConfigError with one line."""
    try:
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or ""
        raise ConfigError(f"{key}: {str(e).splitlines()[0]}" if key else str(e).splitlines()[0]) from None
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def user_error_status(e: BaseException) -> int:
    """The tools' ending for a failure: a user error as one `error:` line on stderr and exit status 2; anything else
    (a real bug) raised again, with its traceback."""
    line = describe_user_error(e)
    if line is None:
        raise e
    print(f"error: {line}", file=sys.stderr)
    return 2


def describe_user_error(e: BaseException) -> str | None:
    """One line for a mistake in the command line or config; None for anything else (a real bug: traceback)."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    if isinstance(e, MissingConfigException) and e.missing_cfg_file and "/" in e.missing_cfg_file:
        group, _, option = e.missing_cfg_file.rpartition("/")
        options = ", ".join(sorted(e.options or []))
        return f"unknown {group} {option!r}; choose one of: {options}" if options else str(e).splitlines()[0]
    if isinstance(e, ConfigCompositionException):
        head = str(e).splitlines()[0].rstrip(".")
        cause = e.__cause__
        if "Could not override" in head or (cause is not None and "not in struct" in str(cause)):
            key = head.split("'")[1] if "'" in head else head
            from trainer.policies import moved_parameter

            moved = moved_parameter(key.removeprefix("policy.")) if key.startswith("policy.") else None
            if moved:  # per_block's and auto's treatment parameters sit under policy.params
                return (
                    f"unknown config key {key!r} for this policy: it is a treatment's own parameter, which "
                    f"per_block and auto take as {moved}"
                )
            return f"unknown config key {key!r}; see the valid keys with: python train.py --cfg job"
        if cause is not None:
            return f"{head}: {str(cause).splitlines()[0]}"
        return head
    if isinstance(e, OverrideParseException):
        return f"cannot parse the command line: {str(e).splitlines()[0]}"
    if isinstance(e, OmegaConfBaseException):
        key = getattr(e, "full_key", "") or ""
        return f"{key}: {str(e).splitlines()[0]}" if key else str(e).splitlines()[0]
    if isinstance(e, UserError):
        return str(e).splitlines()[0]
    if isinstance(e, OSError) and e.filename:  # e.g. Hydra creating a run folder where it cannot
        return f"cannot write {e.filename}: {e.strerror}; pass hydra.run.dir=<a writable folder>"
    return None


def vocab_for(config: Config, tokenizer_vocab: int) -> int:
    """The vocabulary a native model is built with (model.vocab_size, else the tokenizer's): the one rule the run,
    trainer.check and the estimator share. It must cover the tokenizer's ids; an HF model keeps its own."""
    v = config.model.vocab_size
    if v is not None and v < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={v} is smaller than the tokenizer's {tokenizer_vocab}; "
            "leave it null to take the tokenizer's size"
        )
    return tokenizer_vocab if v is None else v


def model_vocab(config: Config) -> int | None:
    """The vocabulary the model is built with, from the config alone (the estimator, the planner's estimate and the
    benchmarks read no data): vocab_for with the tokenizer's size (byte: 256, bpe: data.bpe_vocab_size); with
    data.tokenizer=model, model.vocab_size or None (an HF model keeps its own)."""
    tokenizer = {"byte": 256, "bpe": config.data.bpe_vocab_size}.get(config.data.tokenizer)
    return vocab_for(config, tokenizer) if tokenizer is not None else config.model.vocab_size


class OneLineParser(argparse.ArgumentParser):
    """The CLIs' argument parser: a bad argument is one `error:` line naming --help, exit 2, like every other
    user error here (argparse's own prints its usage block first). The description keeps its line breaks (a tool's
    usage examples read as written), and a help text may say `%` plainly: argparse formats help with `%`, so a lone
    one (`1GiB+5%`) ended `--help` in a traceback."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        if isinstance(kwargs.get("help"), str):
            kwargs["help"] = re.sub(r"%(?!\()", "%%", kwargs["help"])  # `%(default)s` and kin stay argparse's
        return super().add_argument(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def compose_config(overrides: Sequence[str]) -> Config:
    """train.py's config from the same overrides, validated (raises Hydra, Config or Policy errors): the tools'
    (estimator, check, benchmarks) one way to compose it."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return validate(cfg)
