"""The LightningModule: any decoder (models/) with an activation-memory policy and a loss head, AdamW groups,
warm-up + cosine LR. It sees the model through the decoder contract (models/adapter.py) only."""

from __future__ import annotations

import logging
import math
import random
import warnings
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
from torch import nn

from models import build_model
from models.adapter import DecoderAdapter, adapter_for
from trainer.core.schema import ConfigError, ModelConfig, OptimConfig
from trainer.errors import PolicyError
from trainer.loss import LossConfig, head_loss
from trainer.measure import metrics as M
from trainer.parallel import tensor as tensor_parallel
from trainer.parallel.gloo import settle_on_gloo
from trainer.policies import Policy, apply_policy, build_policy, draws_dropout


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up to 1, then cosine down to `min_ratio` at `total` steps, flat after."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matmul weights only: decaying norms, biases or embeddings pulls them to zero for no benefit."""
    decay, no_decay = [], []
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for p in model.parameters():  # tied weights appear once
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(trained: nn.Module, o: OptimConfig, foreach: bool | None = None) -> torch.optim.AdamW:
    """The run's AdamW over `trained`'s parameters (`param_groups`), as `optim` configures it."""
    groups = param_groups(trained, o.weight_decay)
    return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, foreach=foreach)  # type: ignore[arg-type]


def rng_state() -> dict[str, Any]:
    """This process's RNG states, the ones that draw dropout masks: tensors and tuples of ints only, so a checkpoint
    holding them still loads with weights_only=True."""
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    """Put back what `rng_state` took (CUDA's where this process sees as many devices)."""
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])


log = logging.getLogger(__name__)
_STAND_IN_EXPLAINED = False


def explain_group_stand_ins(model: nn.Module) -> None:
    """A plan that runs several blocks as one region (sqrt, every_k, per_block groups) makes each block before a
    group's last return its input unchanged, as a stand-in: the group runs at its last block. FSDP2 warns, at every
    such block and step, that a returned view would lose its pre-backward hook under an in-place op; the decoder's
    loop only passes the stand-in on to the next block, never writes into it, so that warning cannot apply here.
    It is silenced for those blocks' message alone and explained once instead."""
    global _STAND_IN_EXPLAINED
    plan = getattr(model, "activation_plan", None)
    if plan is None or all(seg.stop - seg.start == 1 for seg in plan.segments):
        return
    warnings.filterwarnings(
        "ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor", category=UserWarning
    )
    if not _STAND_IN_EXPLAINED:
        _STAND_IN_EXPLAINED = True
        log.warning(
            "FSDP2: blocks before a group's last return their input as a stand-in (the group runs at its last "
            "block); the decoder never writes into it in place, so torch's 'returned a view tensor' warning is off"
        )


class DecoderModule(L.LightningModule):
    # AdamW's implementation: None lets torch pick (foreach for CUDA parameters, the per-parameter loop on CPU).
    # The estimator sets True for a CUDA estimate: torch never picks foreach for fake tensors, whose temporaries
    # (about one copy of the parameters) a CUDA run has.
    optimizer_foreach: bool | None = None
    # FSDP2's MixedPrecisionPolicy parameter dtype (trainer/precision.py: fsdp2_param_dtype), set by the builder for
    # precision=bf16-mixed under trainer=fsdp2: shards stay fp32, all-gathers and compute run in it. None: shards
    # are all-gathered and used in their own dtype.
    fsdp_param_dtype: torch.dtype | None = None
    # Megatron's tensor parallelism (trainer/parallel/tensor.py), set by the builder from trainer.tensor_parallel /
    # trainer.sequence_parallel / trainer.loss_parallel; applied on the mesh's second (tensor-parallel) dimension
    # when it has more than one.
    sequence_parallel: bool = True
    loss_parallel: bool = True

    def __init__(
        self,
        model: ModelConfig | dict[str, Any],
        policy: Policy | dict[str, Any] | str = "none",
        optim: OptimConfig | dict[str, Any] | None = None,
        max_steps: int = 1000,
        compile: bool = False,
        loss: LossConfig | dict[str, Any] | None = None,
        vocab_size: int | None = None,
        hf_config: Any = None,
    ) -> None:
        """`vocab_size`: the tokenizer's (a native model is built with it); `hf_config`: an HF model's config,
        already read (model=hf), so its folder is read once."""
        super().__init__()
        self.model_config = model if isinstance(model, ModelConfig) else ModelConfig(**model)
        self.optim = optim if isinstance(optim, OptimConfig) else OptimConfig(**(optim or {}))
        self.loss_config = loss if isinstance(loss, LossConfig) else LossConfig(**(loss or {}))
        self.policy = policy if isinstance(policy, Policy) else build_policy(policy)
        self.max_steps = max_steps
        self.compile = compile
        self._compiled = False
        self._sharded = False
        self.last_loss: torch.Tensor | None = None
        self.model = build_model(self.model_config, vocab_size, hf_config)
        try:  # the head must compute the model's own objective (its logit transform), or refuse now
            self.loss_config.check_transform(self.adapter.logit_transform)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # Plain dicts only: checkpoints stay loadable with weights_only=True.
        self.save_hyperparameters(
            {
                "model": asdict(self.model_config),
                "optim": asdict(self.optim),
                "loss": asdict(self.loss_config),
                "policy": self.policy.cfg.name,
                "vocab_size": self.adapter.head.weight.shape[0],
            },
            logger=False,
        )
        refusal = self.policy.refusal(compile, draws_dropout(self.model))
        if refusal is not None:
            raise PolicyError(refusal)
        apply_policy(self.model, self.policy)
        self._val_loss_sum = torch.zeros(())
        self._val_batches = 0

    @property
    def adapter(self) -> DecoderAdapter:
        return adapter_for(self.model)

    def trained(self) -> nn.Module:
        """What the optimizer steps: the model (a pipeline rank: its stages)."""
        return self.model

    def plan_described(self) -> str:
        """The installed plan, for the summary and the log."""
        return self.model.activation_plan.describe()

    def model_described(self) -> dict[str, Any]:
        """The model's shape, for the summary and TensorBoard's HParams."""
        return self.adapter.describe()

    def configure_model(self) -> None:
        # Lightning's ModelParallelStrategy hands us a device mesh: tensor parallelism on its tensor-parallel
        # dimension, then FSDP2 on its data-parallel one, each decoder layer, then the root (torchtitan's order). The
        # policy was applied in __init__ as forward overrides, which call the layers' own modules, so TP's hooks and
        # collectives run inside it (and again in its recompute) and recompute happens inside each shard's
        # all-gather/free window.
        mesh = self.device_mesh
        if mesh is not None and not self._sharded:
            from torch.distributed.fsdp import fully_shard

            from trainer.precision import mp_policy

            # By position: (data parallel, tensor parallel), as ModelParallelStrategy makes it and the estimator fakes
            # it under names of its own; a 1-D mesh is data parallel alone.
            names = mesh.mesh_dim_names or ()
            dp_mesh = mesh[names[0]] if mesh.ndim == 2 else mesh
            if mesh.ndim == 2 and mesh.size(1) > 1:
                tensor_parallel.apply(self.model, mesh[names[1]], self.sequence_parallel, self.loss_parallel)
            kwargs: dict[str, Any] = {"shard_placement_fn": tensor_parallel.fsdp_placement}
            if self.fsdp_param_dtype is not None:
                kwargs["mp_policy"] = mp_policy(self.fsdp_param_dtype)
            layers = list(self.adapter.layers)
            for i, layer in enumerate(layers):
                # torchtitan's default: the last block keeps its parameters gathered after the forward, since the
                # backward starts with it and would gather them again at once (FSDP2's root keeps its own too)
                fully_shard(layer, mesh=dp_mesh, reshard_after_forward=i < len(layers) - 1, **kwargs)
                settle_on_gloo(layer, dp_mesh.get_group())
            fully_shard(self.model, mesh=dp_mesh, **kwargs)
            settle_on_gloo(self.model, dp_mesh.get_group())
            self._sharded = True
            explain_group_stand_ins(self.model)
        # After the policy (so compile sees the checkpoint regions) and once the model is on its device. Split by
        # TP, each layer is compiled on its own, as torchtitan compiles: compiled whole, the embedding split by
        # vocabulary hands dynamo a DTensor placement (_MaskPartial) whose mask it cannot trace under FSDP2.
        if self.compile and not self._compiled:
            backend = self.policy.compile_backend()
            if getattr(self.model, "tensor_parallel_degree", 1) > 1:
                for layer in self.adapter.layers:
                    layer.compile(backend=backend)
            else:
                self.model.compile(backend=backend)
            self._compiled = True

    def loss_of(self, batch: tuple[torch.Tensor, torch.Tensor], loss: LossConfig | None = None) -> torch.Tensor:
        """The training loss of one micro-batch: the decoder's hidden states through the loss head (`loss`: another
        head than the configured one, as the planner compares them)."""
        x, y = batch
        adapter = self.adapter
        with tensor_parallel.loss_context(self.model):
            loss = head_loss(adapter.hidden(x), adapter.head, y, loss or self.loss_config, adapter.logit_transform)
        return tensor_parallel.whole(loss)  # a loss computed on split logits: the same value on every rank

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        with tensor_parallel.loss_context(self.model):  # the split cross-entropy's backward runs under it too
            super().backward(loss, *args, **kwargs)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V), for inference; training goes through `loss_of`."""
        return tensor_parallel.whole(self.adapter.logits(self.adapter.hidden(idx)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss_of(batch)
        self.last_loss = loss.detach()  # read by the numeric guard to name what went non-finite
        # The per-optimizer-step train/loss (mean over micro-batches) is logged by the measuring callback;
        # this one only feeds the progress bar.
        self.log("loss", loss.detach(), prog_bar=True, logger=False, batch_size=batch[0].size(0))
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val_loss_sum = torch.zeros((), device=self.device)
        self._val_batches = 0

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss_of(batch)
        self._val_loss_sum += loss.detach().float()
        self._val_batches += 1
        return loss

    def on_validation_epoch_end(self) -> None:
        if not self._val_batches:
            return
        val_loss = self._val_loss_sum / self._val_batches
        self.log(M.VAL_LOSS, val_loss, prog_bar=True, sync_dist=True)
        self.log(M.VAL_PPL, torch.exp(val_loss), sync_dist=True)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning restores weights, optimizer, schedule and loop counters; the RNG that draws dropout masks is
        # ours to keep, or a resumed run would diverge from an uninterrupted one.
        checkpoint["rng_state"] = rng_state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        rng = checkpoint.get("rng_state")
        if rng:
            restore_rng(rng)

    def configure_optimizers(self) -> Any:
        o = self.optim
        opt = adamw(self.trained(), o, self.optimizer_foreach)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: warmup_cosine(s, o.warmup_steps, self.max_steps, o.min_lr / o.lr)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
