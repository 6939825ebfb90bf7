"""Pipeline stages as Lightning trains them: trainer.pipeline_parallel=p runs the decoder cut into stages
(trainer/parallel/pipeline.py), one rank each (or `pipeline_virtual` each under interleaved 1F1B), under torch's own
schedule, through the same Trainer, callbacks and run folder as every other run.

    python train.py model=llama-tiny trainer.devices=2 trainer.pipeline_parallel=2 accum=4 policy=full

`PipelineModule` is the run's LightningModule with the model pruned to the rank's stages at `configure_model` (the
policy installed on each stage as the estimator installs it: a per-block plan's slice, any other policy on the stage's
own blocks). A training step is one schedule step over the whole step's batch (the loader serves batch_size × accum
rows; the schedule splits them into `accum` micro-batches, as torchtitan feeds its schedules), so Lightning runs it
under manual optimization: the schedule's backward, then the optimizer step, where the measuring callback closes its
activation window and the gradients are clipped by the whole model's norm (the squared norms summed over the ranks).
The last stage's mean loss is broadcast to every rank, so rank 0 (the first stage) logs and writes it. Validation reads
micro-batches, each forward through the stages in order. More devices than stages replicate the pipeline (data
parallelism): each replica reads its share, and its gradients are averaged with the other replicas' of its stages.

`PipelineStrategy` is Lightning's ModelParallelStrategy over a ("pipeline_parallel", "data_parallel") mesh: no
wrapper, a pipeline's ranks read the same batches, and a checkpoint is one file holding the whole model under its own
keys (each rank's stages renamed back to the unpruned model's names and gathered on rank 0), its AdamW state keyed by
those names, and each rank's RNG state: it loads into a model of one process (`load_state_dict`), and a run with the
same stages resumes from it exactly.

Near tools: torchtitan's pipelining trainer (the same schedules and the same global-name checkpoints, through torch's
distributed checkpoint: a folder of shards); Lightning has no pipeline strategy of its own.

Known limitations: fp32 only (the estimate of a stage is); data parallelism beside the stages by whole-gradient
all-reduce (no FSDP2, no tensor parallelism yet); one node; eager, with a policy the eager step runs (not auto or
memory_budget); tested on CPU processes (gloo) only.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from models.adapter import adapter_for
from trainer.core.module import DecoderModule, restore_rng, rng_state
from trainer.errors import ConfigError
from trainer.parallel.pipeline import (
    PipelineLayout,
    PipelineStageModule,
    build_schedule,
    clip_grad_norm,
    global_names,
    pipeline_stage,
    prune_to_stage,
    stage_layers,
    stage_loss,
    stage_policy,
    step_loss,
    step_rank,
)
from trainer.policies import apply_policy, remove_policy


class PipelineModule(DecoderModule):
    """The run's LightningModule over the rank's pipeline stages (`configure_model` prunes the model to them)."""

    def __init__(
        self, *args: Any, pipeline: PipelineLayout, micro_batch: tuple[int, int], grad_clip: float, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False
        self.pipeline, self.micro_batch, self.grad_clip = pipeline, micro_batch, grad_clip
        # The whole model's description, before configure_model prunes it to this rank's stages.
        self._whole = (self.model.activation_plan.describe(), self.adapter.describe())
        self.more_stages = nn.ModuleList()  # the rank's stages after its first (interleaved 1F1B)
        self.stage_ids: list[int] = []
        self._names: dict[str, str] = {}  # this module's state-dict key → the whole model's (the checkpoint's)
        self._schedule: Any = None

    # -- the model: pruned to the rank's stages ------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.stage_ids:
            return
        p, mesh = self.pipeline, self.device_mesh
        if mesh is None:
            raise ConfigError("pipeline stages are cut on a run's ranks: train them through train.py or trainer.check")
        self.stage_ids = p.stages_of(self.pipeline_rank)
        whole = self.model
        remove_policy(whole)  # each stage installs its own share below
        n_layer, attention = len(adapter_for(whole).layers), self.adapter.attention
        models = [whole, *(copy.deepcopy(whole) for _ in self.stage_ids[1:])]
        names = [global_names(m) for m in models]
        for model, stage in zip(models, self.stage_ids, strict=True):
            layers = stage_layers(n_layer, p.n_stages, stage)
            policy = stage_policy(self.policy.cfg, n_layer, layers, attention)
            apply_policy(prune_to_stage(model, stage, p.n_stages), policy)
        self.model = models[0]
        self.more_stages = nn.ModuleList(models[1:])
        prefixes = ["model.", *(f"more_stages.{i}." for i in range(len(models) - 1))]
        for prefix, model, before in zip(prefixes, models, names, strict=True):
            for key, t in model.state_dict(keep_vars=True).items():
                self._names[prefix + key] = "model." + before[id(t)]

    def stage_models(self) -> list[nn.Module]:
        return [self.model, *self.more_stages]

    def trained(self) -> nn.Module:
        return nn.ModuleList(self.stage_models())

    def plan_described(self) -> str:
        return self._whole[0]

    def model_described(self) -> dict[str, Any]:
        return self._whole[1]

    @property
    def pipeline_rank(self) -> int:
        """This rank's place among the stages' ranks (its replica's pipeline)."""
        return self.device_mesh["pipeline_parallel"].get_local_rank()

    @property
    def group(self) -> Any:
        """The process group of this rank's pipeline: its sends and receives, the loss's broadcast, the norm's sum."""
        return self.device_mesh["pipeline_parallel"].get_group()

    def average_replicas(self) -> None:
        """Data parallelism beside the stages: each gradient averaged over the replicas of this rank's stages, in
        place (DDP's arithmetic, without its buckets: gradients whole, after the schedule's backward)."""
        replicas = self.device_mesh["data_parallel"]
        if replicas.size() == 1:
            return
        for param in self.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, group=replicas.get_group())
                param.grad.div_(replicas.size())

    def schedule(self) -> Any:
        """torch's schedule over the rank's stages, made at the first step (the stages on their device by then)."""
        if self._schedule is None:
            p, models = self.pipeline, self.stage_models()
            wrappers = [PipelineStageModule(m) for m in models]  # not submodules: the stages are the models
            dtype, hidden = next(models[0].parameters()).dtype, models[0].config.n_embd
            stages = [
                pipeline_stage(w, s, p.n_stages, self.micro_batch, hidden, dtype, self.group)
                for w, s in zip(wrappers, self.stage_ids, strict=True)
            ]
            last = wrappers[self.stage_ids.index(p.n_stages - 1)] if p.n_stages - 1 in self.stage_ids else wrappers[0]
            self._schedule = build_schedule(p.schedule, stages, p.n_microbatches, stage_loss(last, self.loss_config))
        return self._schedule

    # -- steps ---------------------------------------------------------------------------------------------------
    def _run(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One schedule step over the whole step's batch; the last stage's mean loss, on every rank."""
        x, y = batch
        losses = step_rank(self.schedule(), self.stage_ids, self.pipeline.n_stages, x, y)
        return step_loss(losses, self.group, self.pipeline.ranks - 1, self.device)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        loss = self._run(batch)  # each micro-batch's backward; the gradients of the step's mean
        self.average_replicas()
        self.last_loss = loss
        optimizer.step()  # the callbacks' on_before_optimizer_step (measuring, guard), then ours (clipping)
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()  # type: ignore[union-attr]
        self.log("loss", loss, prog_bar=True, logger=False, batch_size=batch[0].size(0))
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        clip_grad_norm(list(self.parameters()), self.grad_clip, self.group)

    def grad_norm(self) -> float | None:
        return float(clip_grad_norm(list(self.parameters()), 0.0, self.group))

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._forward_through(batch)
        self._val_loss_sum += loss.float()
        self._val_batches += 1
        return loss

    def _forward_through(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One micro-batch's loss, forward only, through the stages in order (each stage's rank receives the stream
        from the previous stage's and sends it on): validation reads the rows one process reads, a micro-batch at
        a time, where the schedule would need a step's micro-batches at once. The loss on every rank."""
        x, y = batch
        p, models = self.pipeline, self.stage_models()
        loss = torch.zeros((), device=self.device)
        for stage in range(p.n_stages):
            if stage % p.ranks != self.pipeline_rank:
                continue
            model = models[self.stage_ids.index(stage)]
            if stage == 0:
                stream = x
            else:
                param = next(model.parameters())
                stream = torch.empty(*x.shape, model.config.n_embd, dtype=param.dtype, device=param.device)
                dist.recv(stream, group_src=(stage - 1) % p.ranks, group=self.group)
            out = PipelineStageModule(model)(stream)
            if stage < p.n_stages - 1:
                dist.send(out.contiguous(), group_dst=(stage + 1) % p.ranks, group=self.group)
            else:
                loss = stage_loss(PipelineStageModule(model), self.loss_config)(out, y).detach()
        dist.broadcast(loss, group_src=self.pipeline.ranks - 1, group=self.group)
        return loss

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a pipeline stage has no whole-model forward; load its checkpoint into one process")

    def whole_grads(self) -> dict[str, torch.Tensor]:
        """This rank's stages' gradients under the whole model's parameter names (copies; trainer.check)."""
        return {self._names[n]: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None}

    # -- checkpoints: the whole model's names; every rank's RNG ---------------------------------------------------
    def whole_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stages under the whole model's keys (on the CPU)."""
        return {self._names[k]: v.detach().cpu() for k, v in self.state_dict().items()}

    def load_whole_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """This rank's share of a whole-model state dict; a key of its stages that `state` lacks is one line."""
        missing = [k for k in self._names.values() if k not in state]
        if missing:
            raise KeyError(f"the checkpoint has no {missing[0]}: it is not this model's")
        self.load_state_dict({k: state[whole] for k, whole in self._names.items()})

    def whole_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state and groups keyed by the whole model's parameter names."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        state = get_optimizer_state_dict(self, optimizer, options=StateDictOptions(cpu_offload=True))
        return {
            "state": {self._names[k]: v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [self._names[k] for k in g["params"]]} for g in state["param_groups"]],
        }

    def load_whole_optimizer_state(self, optimizer: torch.optim.Optimizer, whole: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        local = {v: k for k, v in self._names.items()}
        mine = {
            "state": {local[k]: v for k, v in whole["state"].items() if k in local},
            "param_groups": [
                {**g, "params": [local[k] for k in g["params"] if k in local]} for g in whole["param_groups"]
            ],
        }
        set_optimizer_state_dict(self, optimizer, mine)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Each rank's own draws (its stages' dropout): gathered, so every rank resumes with its own.
        gathered: list[Any] = [None] * self.pipeline.ranks
        dist.all_gather_object(gathered, rng_state(), group=self.group)
        checkpoint["rng_state"] = {"ranks": gathered}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        ranks = (checkpoint.get("rng_state") or {}).get("ranks")
        if ranks:
            restore_rng(ranks[dist.get_rank(self.group)])


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' optimizer states as one: the union of their states, each group's parameters in rank order."""
    state: dict[str, Any] = {}
    for part in parts:
        state.update(part["state"])
    groups = [
        {**group, "params": [name for part in parts for name in part["param_groups"][i]["params"]]}
        for i, group in enumerate(parts[0]["param_groups"])
    ]
    return {"state": state, "param_groups": groups}


class PipelineStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy with a 2-D mesh, ("pipeline_parallel", "data_parallel") as torchtitan orders
    it (the stages' ranks outermost): a pipeline's ranks read the same batches (the first stage takes the tokens, the
    last the targets), each replica its share; whole-model checkpoints (`PipelineModule.whole_state_dict`) gathered
    on rank 0."""

    def __init__(self, ranks: int, replicas: int = 1) -> None:
        super().__init__(data_parallel_size=replicas, tensor_parallel_size=ranks, save_distributed_checkpoint=False)
        self.ranks, self.replicas = ranks, replicas

    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self._setup_distributed()
        self._device_mesh = init_device_mesh(
            self.root_device.type,
            (self.ranks, self.replicas),
            mesh_dim_names=("pipeline_parallel", "data_parallel"),
        )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def _module(self) -> PipelineModule:
        module = self.lightning_module
        assert isinstance(module, PipelineModule)
        return module

    def _on_rank0(self, part: Any) -> list[Any]:
        parts: list[Any] = [None] * self.world_size if self.global_rank == 0 else []
        dist.gather_object(part, parts if self.global_rank == 0 else None, dst=0)
        return parts

    def lightning_module_state_dict(self) -> dict[str, Any]:
        parts = self._on_rank0(self._module().whole_state_dict())
        return {k: v for part in parts for k, v in part.items()}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's wrapper
        parts = self._on_rank0(self._module().whole_optimizer_state(optimizer))
        return _merge(parts) if parts else {}

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        module = self._module()
        module.load_whole_state_dict(checkpoint.pop("state_dict"))
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            module.load_whole_optimizer_state(optimizer, state)
        return checkpoint
