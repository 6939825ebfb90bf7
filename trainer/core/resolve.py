"""What a configuration settles into on a machine, settled once: the device, the precision (auto chosen by the
hardware, every refusal of a precision the device or the strategy cannot run), the Hugging Face config, the
vocabulary, the data-parallel world and the tensor-parallel degree. The run, `trainer.check`, the estimator's
session, a configuration's plan and the benchmarks all start here, so none of them settles a fact its own way.

    facts = resolve(config)                       # the run's machine: the device Lightning will train on
    facts = resolve(config, "cuda", estimate=True)  # an estimate for CUDA, on a machine that may have none
    facts.device, facts.precision, facts.why, facts.hf_config, facts.vocab, facts.world, facts.tensor_parallel

Lightning settles the same facts inside `Trainer(...)` (its accelerator and precision connectors); they are settled
here before it, because the estimator and the checker build the module without a Trainer, and a refusal must come
before any data is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer import precision as precision_
from trainer.core.schema import Config, model_vocab
from trainer.errors import ConfigError
from trainer.parallel.pipeline import SCHEDULES, PipelineLayout, layout
from trainer.policies import build_policy, needs_attention_seam, no_seam_refusal


@dataclass(frozen=True)
class Resolved:
    device: str  # "cpu" or "cuda": what the run trains on, or what the estimate is for
    precision: str  # settled: never "auto"
    why: str  # one line: how the precision was chosen (the run logs it when it was auto)
    hf_config: Any  # model=hf: its transformers config, read once; None for a native family
    vocab: int | None  # the vocabulary the model is built for, without reading data (None: the tokenizer's, later)
    world: int  # the data-parallel ranks FSDP2 shards over (trainer.strategy=fsdp2), else 1
    tensor_parallel: int = 1  # the ranks each layer is split over (trainer.tensor_parallel), 1 without


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
    if isinstance(depth, int) and not policy.caps.planned_first and not has_attention_seam(cls):
        policy.check(depth, config.model.attention)
        if needs_attention_seam(policy, depth):
            raise no_seam_refusal(policy, cls.__name__)
    limit = max_positions(loaded)
    if limit is not None and config.seq_len > limit:
        raise ConfigError(
            f"seq_len={config.seq_len} exceeds {config.model.name_or_path}'s {limit} positions; lower seq_len"
        )
    return loaded


def sharded_world(config: Config) -> int:
    """The data-parallel ranks FSDP2 shards over (trainer.strategy=fsdp2; the devices a tensor-parallel group does
    not take), else 1."""
    t = config.trainer
    if t.strategy != "fsdp2":
        return 1
    if not isinstance(t.devices, int) or t.devices < 1:
        raise ConfigError(f"trainer.strategy=fsdp2 needs a device count, e.g. trainer.devices=2 (got {t.devices})")
    return t.devices * t.num_nodes // tensor_parallel(config)


def tensor_parallel(config: Config) -> int:
    """The tensor-parallel degree, its refusals that need no model: it runs on FSDP2's 2-D mesh and divides the
    devices. What it must divide in the model is checked on the model (trainer/parallel/tensor.py)."""
    t = config.trainer
    degree = t.tensor_parallel
    if degree == 1:
        return 1
    if t.strategy != "fsdp2":
        raise ConfigError(
            f"trainer.tensor_parallel={degree} runs on FSDP2's 2-D device mesh; add trainer=fsdp2 "
            f"trainer.devices={degree} (or a multiple of it)"
        )
    if not isinstance(t.devices, int) or (t.devices * t.num_nodes) % degree:
        raise ConfigError(
            f"trainer.tensor_parallel={degree} does not divide the {t.devices} × {t.num_nodes} devices; "
            f"set trainer.devices to a multiple of {degree}"
        )
    policy = build_policy(config.policy)
    if policy.caps.requires_compile:
        raise ConfigError(
            f"policy={policy.name} with trainer.tensor_parallel={degree}: torch's budget partitioner cannot size the "
            "process group a split layer's collectives take; use another policy (full, selective, op_sac) or "
            "trainer.tensor_parallel=1"
        )
    if why := loss_refused_under_tensor_parallel(config.loss.name, degree):
        raise ConfigError(why)
    return degree


def pipeline_parallel(config: Config) -> PipelineLayout | None:
    """trainer.pipeline_parallel's layout (None without stages), its refusals first: what a pipeline run and its
    estimate do not cover yet is refused in one line, not run or estimated as something else."""
    t = config.trainer
    if t.pipeline_parallel == 1:
        if t.pipeline_virtual > 1:
            raise ConfigError(f"trainer.pipeline_virtual={t.pipeline_virtual} needs trainer.pipeline_parallel > 1")
        if t.pipeline_schedule not in SCHEDULES:
            raise ConfigError(f"trainer.pipeline_schedule={t.pipeline_schedule}: choose one of {', '.join(SCHEDULES)}")
        return None
    degree = t.pipeline_parallel
    what = f"trainer.pipeline_parallel={degree}"
    if config.model.family == "hf":
        raise ConfigError(f"{what} cuts a native family's layers (gpt, llama); a Hugging Face model has no pruned form")
    if config.model.tie_embeddings:
        raise ConfigError(
            f"{what}: tied embeddings put one weight on the first and the last stage; set model.tie_embeddings=false"
        )
    if t.strategy not in ("auto", "ddp") or t.tensor_parallel > 1:
        raise ConfigError(
            f"{what} with trainer.strategy={t.strategy} or tensor parallelism is not run or estimated yet; "
            "use trainer=ddp"
        )
    if t.num_nodes != 1:
        raise ConfigError(f"{what} runs on one node yet: set trainer.num_nodes=1")
    if not isinstance(t.devices, int) or t.devices % degree:
        raise ConfigError(
            f"{what} runs one stage's rank a device, the pipeline replicated over the rest: trainer.devices="
            f"{t.devices} does not split into {degree} stages' ranks; set trainer.devices to a multiple of {degree}"
        )
    policy = build_policy(config.policy)
    if t.compile or policy.caps.requires_compile or policy.caps.planned_first:
        raise ConfigError(
            f"{what} runs and is estimated eager, with a policy the eager step runs (not auto or memory_budget; a "
            "per-block plan names the whole model's blocks): drop trainer.compile and choose another policy"
        )
    return layout(degree, t.pipeline_schedule, t.pipeline_virtual, config.accum, config.model.n_layer)


def loss_refused_under_tensor_parallel(loss: str, degree: int) -> str | None:
    """Why loss head `loss` cannot run split `degree` ways (None: it can): chunked and fused read the head's weight
    directly, which tensor parallelism splits by vocabulary, outside the head's module and its hooks."""
    if degree == 1 or loss == "standard":
        return None
    return (
        f"loss={loss} reads the head's weight directly, which tensor parallelism splits by vocabulary; use "
        "loss=standard with trainer.tensor_parallel"
    )


def settle_precision(config: Config, device: str, *, estimate: bool = False) -> tuple[str, str]:
    """The precision a run of `config` trains in on `device`, and one line saying why; a precision the device or the
    strategy cannot run is refused here, in one line naming the fix. `estimate`: for a CUDA estimate on a machine
    with no CUDA device to ask, auto is bf16-mixed (a GPU with bf16, Ampere or newer, is assumed)."""
    requested = config.precision
    if config.trainer.pipeline_parallel > 1:  # the stages' estimate, and so their run, is fp32's alone yet
        if requested == "auto":
            return "32-true", "precision=auto → 32-true: pipeline stages run in fp32 only yet"
        if requested != "32-true" and not estimate:  # the estimate says it in its own words
            raise ConfigError(
                f"trainer.pipeline_parallel runs in fp32 only yet, not precision={requested}: set precision=32-true"
            )
    if device == "cuda" and not torch.cuda.is_available():
        chosen = "bf16-mixed" if requested == "auto" else requested
        why = (
            "precision=auto → bf16-mixed: no CUDA device here to ask, so a GPU with bf16 (Ampere or newer) is "
            "assumed; precision=16-mixed or 32-true estimates others"
            if requested == "auto"
            else f"precision={requested} (as configured)"
        )
    else:
        chosen, why = precision_.resolve(requested, device)
    refusal = precision_.refuse_under_fsdp2(chosen, config.trainer)
    if refusal:
        raise ConfigError(refusal)
    if chosen == "16-mixed" and device != "cuda":
        fix = "estimate it with --device cuda" if estimate else "use precision=auto, bf16-mixed or 32-true on CPU"
        raise ConfigError(f"precision=16-mixed needs a CUDA GPU; {fix}")
    gpu = device == "cuda" and torch.cuda.is_available()
    if chosen.startswith("bf16") and gpu and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"precision={chosen}: this GPU ({torch.cuda.get_device_name()}) has no bf16; "
            "use precision=16-mixed or 32-true"
        )
    return chosen, why


def resolve(config: Config, device: str | None = None, *, estimate: bool = False) -> Resolved:
    """Every fact `config` settles into on `device` (default: the device the run trains on), refusals first."""
    device = device or train_device(config)
    chosen, why = settle_precision(config, device, estimate=estimate)
    world, tp = sharded_world(config), tensor_parallel(config)
    pipeline_parallel(config)
    policy = build_policy(config.policy)
    if policy.caps.planned_first and config.trainer.compile and world * tp > 1:  # else refused at fit start, per rank
        split = "trainer.tensor_parallel" if tp > 1 else "trainer=fsdp2"
        raise ConfigError(
            f"policy={policy.name} with trainer.compile=true plans on the compiled estimate, which runs on one device "
            f"(not with {split} yet): name the plan instead (policy=per_block policy.blocks=[...]), or drop compile"
        )
    return Resolved(device, chosen, why, hf_config(config), model_vocab(config), world, tp)
