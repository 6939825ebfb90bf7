"""Tensor parallelism (trainer/parallel/tensor.py): LLaMA (ours, and transformers' with its own plan) split
Megatron's way over 2 gloo processes trains as one process does, every policy composes with it, a run of FSDP2 × TP
trains end to end as each rank predicted, and what cannot be split is one line before anything runs."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import CLI_ENV, SMALL, run_cli
from trainer.core import build
from trainer.core.schema import compose_config
from trainer.errors import ConfigError
from trainer.interpreter import lean_exit

# (family, sequence parallel, tied head, attention, loss parallel): the layouts the single-process comparison covers
LAYOUTS = [
    ("llama", True, False, "eager", True),
    ("llama", False, False, "sdpa", False),
    ("llama", True, True, "sdpa", False),
    ("gpt", True, True, "eager", True),
    ("gpt", False, False, "sdpa", True),
]
# Every policy that runs without compile (memory_budget needs compile, and its budget partitioner cannot run on a
# split layer); auto is a planner's choice among these treatments, run end to end below.
POLICIES: list[dict[str, Any]] = [
    {"name": "selective"},
    {"name": "full"},
    {"name": "first_k", "k": 1},
    {"name": "every_k", "k": 2},
    {"name": "sqrt"},
    {"name": "per_block", "blocks": ["selective", "full", "offload", "none"]},
    {"name": "op_sac"},
    {"name": "torchtitan_sac"},
    {"name": "offload", "min_bytes": 0},
]
# Without SP: a checkpoint around the attention's core (selective), around the whole block (full), and per op.
NO_SP_POLICIES: list[dict[str, Any]] = [{"name": "selective"}, {"name": "full"}, {"name": "op_sac"}]
VOCAB, T, B = 64, 16, 2


def _model(tie: bool, attention: str, dropout: float = 0.0, n_layer: int = 2, family: str = "llama") -> torch.nn.Module:
    from models.gpt import GPT, GPTConfig
    from models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    if family == "gpt":  # biases on: the fused projection's bias splits as its weight does
        return GPT(GPTConfig(VOCAB, T, n_layer, 4, 32, dropout=dropout, tie_embeddings=tie, attention=attention))
    shape = dict(n_embd=32, n_head=4, n_kv_head=2, mlp_hidden=64)
    return Llama(
        LlamaConfig(VOCAB, T, n_layer, dropout=dropout, tie_embeddings=tie, attention=attention, **shape)  # type: ignore[arg-type]
    )


def _embedding(model: Any, family: str) -> torch.nn.Module:
    if family == "gpt":
        return model.transformer.wte
    return model.model.embed_tokens if family == "llama" else model.get_input_embeddings()


def _hf_model(attention: str) -> torch.nn.Module:
    """A tiny transformers LlamaForCausalLM (its config carries base_model_tp_plan), built here: no hub."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=T,
        attn_implementation=attention,
    )
    return LlamaForCausalLM(config)


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and every parameter's whole gradient (a DTensor's gathered)."""
    from models.adapter import adapter_for
    from trainer.loss import LossConfig, head_loss
    from trainer.parallel.tensor import loss_context, whole

    torch.manual_seed(7)  # the dropout masks
    adapter = adapter_for(model)
    with loss_context(model):  # loss parallelism: the cross-entropy of split logits, and its backward
        loss = whole(head_loss(adapter.hidden(x), adapter.head, y, LossConfig()))
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return loss.item(), grads


def _dropout_masks(model: torch.nn.Module, mesh: Any, sequence_parallel: bool, x: torch.Tensor) -> dict[str, str]:
    """Each dropout's mask in one forward of the split model, as a digest of where it zeroed."""
    import hashlib

    from models.adapter import adapter_for
    from trainer.parallel import tensor

    masks: dict[str, str] = {}

    def keep(name: str) -> Any:
        def hook(module: torch.nn.Module, inputs: Any, out: torch.Tensor) -> None:
            zeros = (out.to_local() if hasattr(out, "to_local") else out) == 0
            masks[name] = hashlib.sha256(zeros.numpy().tobytes()).hexdigest()

        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout):
            module.register_forward_hook(keep(name))
    tensor.apply(model, mesh, sequence_parallel, True)
    torch.manual_seed(7)
    adapter_for(model).hidden(x)
    return masks


def _worker(rank: int, world: int, store: str, out: str) -> None:
    lean_exit()  # a spawned rank: its exit skips the last full collection
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel import tensor
    from trainer.policies import apply_policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tensor_parallel",))
        torch.manual_seed(1)
        x, y = torch.randint(0, VOCAB, (B, T)), torch.randint(0, VOCAB, (B, T))
        report: dict[str, Any] = {"layouts": [], "policies": {}}
        # ours in every layout, and transformers' with its own plan (no SP: its plans carry none)
        cases = [
            (layout, lambda f=f, t=t, a=a: _model(t, a, family=f)) for layout in LAYOUTS for f, _, t, a, _ in [layout]
        ]
        cases += [(("hf", False, False, a, True), lambda a=a: _hf_model(a)) for a in ("sdpa", "eager")]
        for layout, build in cases:
            one_loss, one = _step(build(), x, y)
            m = build()
            tensor.apply(m, mesh, layout[1], layout[4])
            split_loss, split = _step(m, x, y)
            gpt = layout[0] == "gpt"
            # query rows held: 2 of the 4 heads of size 8 (GPT's fused c_attn: of each of q, k and v)
            attn = m.transformer.h[0].attn.c_attn if gpt else m.model.layers[0].self_attn.q_proj
            report["layouts"].append(
                {
                    "layout": list(layout),
                    "loss": abs(split_loss - one_loss),
                    "grad": max((split[n] - g).abs().max().item() for n, g in one.items()),
                    "tied": m.lm_head.weight is _embedding(m, layout[0]).weight,
                    "local_rows": attn.weight.to_local().shape[0] // (3 if gpt else 1),
                    # transformers' plans keep the head whole: no logits to split, whatever was asked
                    "loss_parallel": m.loss_parallel == (layout[4] and layout[0] != "hf"),
                }
            )
        report["masks"] = {
            f"{family} sp={sp}": _dropout_masks(_model(False, "eager", dropout=0.5, family=family), mesh, sp, x)
            for family in ("llama", "gpt")
            for sp in (True, False)
        }
        for family in ("llama", "gpt"):  # under TP + SP + loss parallelism, with dropout: each against none's
            ref: dict[str, torch.Tensor] = {}
            for cfg in [{"name": "none"}, *POLICIES]:
                m = _model(False, "eager", dropout=0.1, n_layer=4, family=family)
                apply_policy(m, cfg)
                tensor.apply(m, mesh, True, True)
                loss, grads = _step(m, x, y)
                grads["loss"] = torch.tensor(loss)
                ref = ref or grads
                report["policies"][f"{family} {cfg['name']}"] = all(torch.equal(grads[n], g) for n, g in ref.items())
        for family in ("llama", "gpt"):  # without SP: the attention's forked stream met inside each recompute
            ref = {}
            for cfg in [{"name": "none"}, *NO_SP_POLICIES]:
                m = _model(False, "eager", dropout=0.1, family=family)
                apply_policy(m, cfg)
                tensor.apply(m, mesh, False, True)
                loss, grads = _step(m, x, y)
                grads["loss"] = torch.tensor(loss)
                ref = ref or grads
                same = all(torch.equal(grads[n], g) for n, g in ref.items())
                report["policies"][f"{family} sp=False {cfg['name']}"] = same
        Path(out, f"{rank}.json").write_text(json.dumps(report))
        dist.barrier()  # neither rank tears gloo down while the other is still in a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_split_two_ways_trains_as_one_process_and_every_policy_composes(tmp_path: Path) -> None:
    """Two gloo ranks, each holding half the heads and half the MLP: the loss and every gradient match one process
    (not bitwise: the row-split projections sum their partial products across the ranks, another order), with and
    without sequence parallelism, with a tied head, eager and sdpa, LLaMA, GPT and transformers' Llama. Under TP
    every policy's gradients equal none's bitwise, LLaMA's and GPT's, dropout on (recompute replays the same masks
    and the same collectives). With sequence parallelism the two ranks draw their own dropout masks (each holds its
    own stretch of the sequence and its own heads); without it the attention's differ (each rank's heads) and the
    residual stream's are the same (both hold the whole activations)."""
    import torch.multiprocessing as mp

    store = tempfile.mktemp(dir=tmp_path)
    mp.spawn(_worker, args=(2, store, str(tmp_path)), nprocs=2)
    reports = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    masks = [r.pop("masks") for r in reports]
    assert reports[0] == reports[1]  # both ranks gathered the same whole gradients
    for family in ("llama", "gpt"):
        split, whole = (masks[0][f"{family} sp={sp}"] for sp in (True, False))
        assert len(split) == 2 * 2 + (family == "gpt") * 3, split  # every dropout ran (GPT: embedding, MLP)
        assert all(masks[1][f"{family} sp=True"][n] != m for n, m in split.items()), family
        # without SP: the attention's on each rank's own heads, the residual stream's on activations whole on each
        heads = [n for n in whole if "attn_dropout" in n]
        assert len(heads) == 2 and all(masks[1][f"{family} sp=False"][n] != whole[n] for n in heads), family
        replicated = [n for n in whole if n not in heads]
        assert replicated and all(masks[1][f"{family} sp=False"][n] == whole[n] for n in replicated), family
    for case in reports[0]["layouts"]:
        assert case["loss"] <= 1e-6 and case["grad"] <= 1e-6, case
        assert case["local_rows"] == 4 // 2 * 8
        assert case["tied"] == case["layout"][2]  # the shared weight is one DTensor again
        assert case["loss_parallel"], case
    names = ["none", *(p["name"] for p in POLICIES)]
    names += [f"sp=False {n}" for n in ["none", *(p["name"] for p in NO_SP_POLICIES)]]
    assert reports[0]["policies"] == {f"{family} {n}": True for family in ("llama", "gpt") for n in names}


def _policy_overrides(cfg: dict[str, Any]) -> list[str]:
    """A POLICIES entry as the command-line overrides that configure it."""
    out = [f"policy={cfg['name']}"]
    for key, value in cfg.items():
        if key != "name":
            out.append(f"policy.{key}=[{','.join(value)}]" if isinstance(value, list) else f"policy.{key}={value}")
    return out


# GPT's split differs from LLaMA's in its plan (the fused projection, the biases, the position table), not in how a
# policy treats a block: every kind of treatment once (a block, its core, per op, a group), every policy on LLaMA.
GPT_BYTES_POLICIES: list[dict[str, Any]] = [
    {"name": "selective"},
    {"name": "full"},
    {"name": "every_k", "k": 2},
    {"name": "op_sac"},
    {"name": "torchtitan_sac"},
]


def _bytes_worker(rank: int, world: int, store: str, out: str) -> None:
    """Each policy on one rank of TP 2 (SP on), stepped as a run steps it and estimated by the run's own path (the
    estimator inside the run's process group, on fake groups): the activation and whole-step peaks, both ways."""
    lean_exit()
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainer import precision as precision_
    from trainer.core import step
    from trainer.estimate import measure, open_session
    from trainer.policies import build_policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("data_parallel", "tensor_parallel"))
        plugin = precision_.plugin("32-true", "cpu")
        report: dict[str, Any] = {}
        for family, model in (("llama", ["model=llama-tiny"]), ("gpt", ["model=micro"])):
            shape = [*model, "model.n_layer=4", "seq_len=32", "batch_size=2", "precision=32-true", "trainer=fsdp2"]
            shape += [f"trainer.devices={world}", f"trainer.tensor_parallel={world}"]
            session = open_session(compose_config(shape), "cpu")  # one rank on fake tensors, each policy measured
            try:
                for cfg in [{"name": "none"}, *(POLICIES if family == "llama" else GPT_BYTES_POLICIES)]:
                    config = compose_config([*shape, *_policy_overrides(cfg)])
                    torch.manual_seed(0)
                    m = build.module(config, build_policy(config.policy), precision="32-true").train()
                    m._device_mesh = mesh
                    m.configure_model()
                    opt, sched = step.optimizers_of(m)
                    g = torch.Generator().manual_seed(0)
                    batch = tuple(torch.randint(0, 256, (2, 32), generator=g) for _ in range(2))
                    for _ in range(2):  # a warm step: AdamW's state and last step's gradients exist
                        step.bare_step(m, [batch], opt, sched, plugin, grad_clip=config.trainer.grad_clip)
                    meter = step.StepMeter("cpu")
                    step.bare_step(m, [batch], opt, sched, plugin, grad_clip=config.trainer.grad_clip, meter=meter)
                    figures = meter.end(m)
                    est = measure(session, build_policy(config.policy))
                    report[f"{family} {cfg['name']}"] = [
                        figures.activation_bytes,
                        est.activation_bytes,
                        figures.total_bytes,
                        est.peak_bytes,
                    ]
            finally:
                session.close()
        Path(out, f"{rank}.json").write_text(json.dumps(report))
        dist.barrier()  # neither rank tears gloo down while the other is still in a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_each_policy_on_a_tensor_parallel_rank_is_estimated_to_the_byte(tmp_path: Path) -> None:
    """Every policy that runs without compile on LLaMA, each kind of treatment on GPT, on each rank of TP 2 with SP
    (4 layers): the estimator's activation and whole-step peaks, taken as a run takes its own prediction, equal the
    rank's measured ones to the byte (the least of the two ranks': gloo's worker thread can add a collective's
    buffer to one rank's count now and then, docs/layouts.md)."""
    import torch.multiprocessing as mp

    store = tempfile.mktemp(dir=tmp_path)
    mp.spawn(_bytes_worker, args=(2, store, str(tmp_path)), nprocs=2)
    reports = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for case in reports[0]:
        (act, est_act, total, est_total), other = reports[0][case], reports[1][case]
        assert est_act == other[1] and est_total == other[3], case  # every rank predicts the same
        assert min(act, other[0]) == est_act, (case, act, other[0], est_act)
        assert min(total, other[2]) == est_total, (case, total, other[2], est_total)


@pytest.mark.slow
def test_fsdp2_by_tensor_parallel_run_on_four_processes_as_each_rank_predicted(tmp_path: Path) -> None:
    """FSDP2 × TP on a 2 × 2 mesh through Lightning trains as FSDP2 alone on the same two data-parallel ranks does
    (fp32: within a reduction order), every rank holding the same parameters; each rank's activations are smaller
    (half the heads, and with sequence parallelism half of the sequence between them), and every rank's own
    prediction (one rank of the 2 × 2 mesh on fake tensors and a fake process group) equals what it measured, to the
    byte: the activation peak and the step's whole peak (but for gloo's race, below)."""
    runs = {}
    for tp, devices in ((2, 4), (1, 2)):
        run_dir = tmp_path / f"tp{tp}"
        r = run_cli(
            *SMALL,
            "model=llama-tiny",
            "model.n_layer=2",
            "trainer=fsdp2",
            f"trainer.devices={devices}",
            f"trainer.tensor_parallel={tp}",
            "policy=selective",
            "precision=32-true",
            "trainer.max_steps=3",
            f"measure.predict={tp > 1}",
            f"hydra.run.dir={run_dir}",
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        runs[tp] = json.loads((run_dir / "summary.json").read_text())
    split, alone = runs[2], runs[1]
    assert split["world_size"] == 4 and len({r["param_checksum"] for r in split["per_rank"]}) == 1
    assert split["final_train_loss"] == pytest.approx(alone["final_train_loss"], abs=1e-5)
    assert split["activation_peak_mib"] < alone["activation_peak_mib"]
    # every rank predicts the same peak; gloo's worker thread can add a collective's buffer to a rank's measurement
    # now and then (docs/layouts.md), so the least of the ranks' peaks is the count without that race
    predicted = {r["predicted_activation_peak_mib"] for r in split["per_rank"]}
    measured = [r["activation_peak_mib"] for r in split["per_rank"]]
    assert len(predicted) == 1 and min(measured) == predicted.pop() <= max(measured), split.get("prediction_note")
    if split["activation_peak_mib"] == split["predicted_activation_peak_mib"]:  # rank 0 without the race
        assert split["predicted_peak_total_mib"] == split["peak_total_mib"]


@pytest.mark.slow
def test_gpt_on_fsdp2_by_tensor_parallel_keeps_its_ranks_equal_and_each_as_predicted(tmp_path: Path) -> None:
    """GPT (fused q/k/v, biases, a tied head, dropout) on FSDP2 × TP over 4 processes, without sequence parallelism
    so the norms run whole on every rank, launched as a user launches it (no thread count set): every rank's
    parameters stay equal, and every rank measures the activation peak its prediction gives, to the byte — except
    that gloo's worker thread can free a collective's buffer after the step has moved on, adding it to a rank's peak
    now and then (the least of the four ranks is the count without that race)."""
    env = {k: v for k, v in CLI_ENV.items() if k != "OMP_NUM_THREADS"}
    r = run_cli(
        *SMALL,
        "trainer=fsdp2",
        "trainer.devices=4",
        "trainer.tensor_parallel=2",
        "trainer.sequence_parallel=false",
        "policy=selective",
        "precision=32-true",
        "trainer.max_steps=3",
        "measure.predict=true",
        f"hydra.run.dir={tmp_path}",
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = json.loads((tmp_path / "summary.json").read_text())["per_rank"]
    assert len({r["param_checksum"] for r in ranks}) == 1, ranks
    predicted = {r["predicted_activation_peak_mib"] for r in ranks}
    measured = [r["activation_peak_mib"] for r in ranks]
    assert len(predicted) == 1 and min(measured) == predicted.pop() <= max(measured), ranks


def _fsdp_worker(rank: int, world: int, store: str, out: str) -> None:
    lean_exit()
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer.parallel import tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        torch.manual_seed(1)
        x, y = torch.randint(0, VOCAB, (2 * B, T)), torch.randint(0, VOCAB, (2 * B, T))
        one = _model(True, "eager", family="gpt")
        one_loss, one_grads = _step(one, x, y)
        m = _model(True, "eager", family="gpt")
        tensor.apply(m, mesh["tensor_parallel"], True, True)
        for layer in m.transformer.h:
            fully_shard(layer, mesh=mesh["data_parallel"], shard_placement_fn=tensor.fsdp_placement)
        fully_shard(m, mesh=mesh["data_parallel"], shard_placement_fn=tensor.fsdp_placement)
        whole = dict(one.named_parameters())
        layout = [n for n, p in m.named_parameters() if not torch.equal(p.full_tensor(), whole[n])]
        half = slice(B * mesh["data_parallel"].get_local_rank(), B * (mesh["data_parallel"].get_local_rank() + 1))
        _, grads = _step(m, x[half], y[half])  # FSDP2 averages the two halves' gradients: the whole batch's
        report = {
            "misplaced": layout,
            "grad": max((grads[n] - g).abs().max().item() for n, g in one_grads.items()),
            "fused": [str(p) for p in m.transformer.h[0].attn.c_attn.weight.placements],
        }
        Path(out, f"{rank}.json").write_text(json.dumps(report))
        dist.barrier()  # neither rank tears gloo down while the other is still in a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_fused_projection_under_fsdp2_by_tensor_parallel_keeps_its_layout(tmp_path: Path) -> None:
    """GPT's fused q/k/v split strided by TP and then by FSDP2 (by column, so no part is cut through): every
    parameter's DTensor gathers back to the unsplit model's, and one step's gradients on a 2 × 2 mesh match one
    process on the whole batch (within a reduction order)."""
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_worker, args=(4, tempfile.mktemp(dir=tmp_path), str(tmp_path)), nprocs=4)
    reports = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    for report in reports:
        assert report["misplaced"] == [] and report["grad"] <= 1e-6, report
    assert reports[0]["fused"] == ["S(1)", "_S(0, 3)"]  # FSDP2 by column, TP strided by row


def _settle_worker(rank: int, world: int, store: str, out: str) -> None:
    lean_exit()
    import weakref

    import torch.distributed as dist

    from trainer.parallel.gloo import SettledAllGather, SettledReduceScatter

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        group, late = dist.group.WORLD, {"all-gather": 0, "reduce-scatter": 0}
        gather, scatter = SettledAllGather(), SettledReduceScatter()
        for _ in range(300):
            for name in late:
                small = torch.ones(256)
                big = (gather if name == "all-gather" else scatter).allocate(
                    (256 * world,), dtype=small.dtype, device=small.device
                )
                freed: list[int] = []
                refs = [weakref.ref(t.untyped_storage(), lambda _r, f=freed: f.append(1)) for t in (small, big)]
                if name == "all-gather":
                    gather(big, small, group)
                else:
                    scatter(small, big, group, dist.ReduceOp.SUM)
                del small, big  # as FSDP2 drops the buffers after the collective: both freed here, not later
                late[name] += len(freed) < len(refs)
        Path(out, f"{rank}.json").write_text(json.dumps(late))
        dist.barrier()  # neither rank tears gloo down while the other is still in a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_collectives_on_gloo_free_their_buffers_where_fsdp2_drops_them(tmp_path: Path) -> None:
    """Gloo's worker thread keeps a collective's buffers for a moment after wait() returns, so with torch's own
    comms a buffer FSDP2 drops then is freed on that thread some ops later, now and then (and a measured peak moves
    with it). The settled comms FSDP2 gets on gloo free both buffers where the caller drops them: 300 all-gathers and
    300 reduce-scatters on 2 ranks, none late."""
    import torch.multiprocessing as mp

    mp.spawn(_settle_worker, args=(2, tempfile.mktemp(dir=tmp_path), str(tmp_path)), nprocs=2)
    for rank in range(2):
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == {"all-gather": 0, "reduce-scatter": 0}


def _config(*overrides: str) -> Any:
    return compose_config(["model=llama-tiny", "trainer=fsdp2", "trainer.devices=4", *overrides])


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["trainer=default", "trainer.tensor_parallel=2"], "add trainer=fsdp2"),
        (["trainer.devices=3", "trainer.tensor_parallel=2"], "set trainer.devices to a multiple of 2"),
        (["trainer.tensor_parallel=2", "loss=chunked"], "use loss=standard"),
        (["trainer.tensor_parallel=2", "trainer.compile=true", "policy=memory_budget"], "cannot size the process"),
        (["trainer.tensor_parallel=2", "trainer.compile=true", "policy=auto", "policy.budget_mib=9"], "name the plan"),
        (["trainer.compile=true", "policy=auto", "policy.budget_mib=9"], r"not with trainer=fsdp2 yet\): name"),
    ],
)
def test_a_layout_that_cannot_run_is_one_line(overrides: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=says) as e:
        build.resolve(_config(*overrides), "cpu")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["trainer.tensor_parallel=4", "model.n_kv_head=2"], "does not divide model.n_kv_head=2"),
        (
            ["trainer.tensor_parallel=4", "model.n_embd=192", "model.n_head=6", "model.n_kv_head=6"],
            "does not divide model.n_head=6",
        ),
        (["trainer.tensor_parallel=4", "model.n_kv_head=4", "model.vocab_size=250"], "does not divide vocab_size"),
        (["trainer.tensor_parallel=4", "model.n_kv_head=4", "seq_len=30"], "trainer.sequence_parallel=false"),
        (["trainer.tensor_parallel=4", "model=micro", "seq_len=32"], "does not divide model.n_head=2"),
    ],
)
def test_a_model_that_cannot_be_split_is_one_line(overrides: list[str], says: str) -> None:
    config = _config(*overrides)
    with pytest.raises(ConfigError, match=says) as e:
        build.module(config, vocab_size=config.model.vocab_size or 256)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_the_check_runs_a_tensor_parallel_layout_over_its_ranks() -> None:
    """trainer.check with trainer.tensor_parallel=2: two gloo processes, GPT split as the run splits it (fused q/k/v,
    no SP, dropout on): the policy's gradients equal none's bitwise under the split, and the split none's match one
    process's within the layout tolerance (dropout off for that one); a policy planned first, and a degree the model
    cannot be split by, are one line."""
    from trainer.check import render, run_check
    from trainer.check.compare import LAYOUT_TOLERANCE

    config = compose_config(
        [*SMALL[:4], "trainer=fsdp2", "trainer.devices=2", "trainer.tensor_parallel=2"]
        + ["trainer.sequence_parallel=false", "policy=selective", "precision=32-true"]
    )
    result = run_check(config, steps=2)
    assert result.equal and result.exact, render(result)
    assert result.layout is not None and result.layout.equal
    assert 0 < max(d.max_rel for d in result.layout.groups.values()) < LAYOUT_TOLERANCE  # split: another order
    with pytest.raises(ConfigError, match="plans nothing first") as e:
        run_check(_config("trainer.tensor_parallel=2", "policy=auto", "policy.budget_mib=100"))
    assert "\n" not in str(e.value)
    # a degree the model cannot be split by, refused on every rank before any collective: one line here too
    with pytest.raises(ConfigError, match="does not divide model.n_head=2") as e:
        run_check(compose_config([*SMALL[:4], "trainer=fsdp2", "trainer.devices=4", "trainer.tensor_parallel=4"]))
    assert "\n" not in str(e.value)


def test_under_compile_a_split_model_compiles_layer_by_layer() -> None:
    """TP, then the policy, then compile, then FSDP2, torchtitan's order and its unit: each layer compiled on its own
    (compiled whole, the embedding split by vocabulary hands dynamo a placement it cannot trace under FSDP2); a model
    that is not split still compiles whole."""
    from trainer.measure.fake.process_group import fake_mesh, release

    config = compose_config([*SMALL[:4], "model.dropout=0.0", "trainer.compile=true", "precision=32-true"])
    mesh, group = fake_mesh(2, "cpu", tensor_parallel=2)
    try:
        split = build.module(config, "none", precision="32-true")
        split._device_mesh = mesh
        split.configure_model()
    finally:
        release(group)
    whole = build.module(config, "none", precision="32-true")
    whole.configure_model()
    for m, layers, model in ((split, True, False), (whole, False, True)):
        assert all((layer._compiled_call_impl is not None) == layers for layer in m.adapter.layers)
        assert (m.model._compiled_call_impl is not None) == model


@pytest.mark.slow
def test_the_check_passes_a_compiled_tensor_parallel_layout() -> None:
    """trainer.check with trainer.tensor_parallel=2 and trainer.compile=true on two gloo processes: `full`'s
    checkpoint inside each compiled layer of the split model gives none's gradients within the compiled tolerance,
    and the split compiled none matches one eager process within the layout tolerance."""
    from trainer.check import render, run_check

    config = compose_config(
        [*SMALL[:4], "trainer=fsdp2", "trainer.devices=2", "trainer.tensor_parallel=2", "model.dropout=0.0"]
        + ["trainer.compile=true", "policy=full", "precision=32-true"]
    )
    result = run_check(config, steps=1)
    assert result.equal, render(result)
    assert result.layout is not None and result.layout.equal, render(result)


def test_the_estimate_of_a_split_rank_keeps_what_the_split_divides() -> None:
    """One rank of TP 2 on fake tensors: the kept activations per layer shrink (half the heads, and with sequence
    parallelism half the sequence of the norms and residual stream), parameters are half, and so are the FLOPs; the
    head holds less with loss parallelism than with its logits gathered; the loss heads that read the head's weight
    directly say why not, in one line."""
    from trainer.estimate import measure, open_session
    from trainer.loss import LossConfig
    from trainer.policies import build_policy

    def estimate(*overrides: str, loss: str | None = None) -> Any:
        config = compose_config(
            [
                "model=llama-tiny",
                "model.n_layer=2",
                "trainer=fsdp2",
                "trainer.devices=2",
                "precision=32-true",
                "seq_len=32",
                "batch_size=2",
                *overrides,
            ]
        )
        session = open_session(config, "cpu")
        try:
            return measure(session, build_policy("none"), LossConfig(loss) if loss else None)
        finally:
            session.close()

    alone, split = estimate(), estimate("trainer.tensor_parallel=2")
    # FSDP2 shards over the ranks a TP group does not take: 2 alone, 1 × TP 2 split (the norms stay whole)
    assert split.components["parameters"] == pytest.approx(alone.components["parameters"], rel=0.01)
    assert all(s < a for s, a in zip(split.kept_per_layer, alone.kept_per_layer, strict=True))
    assert split.activation_bytes < alone.activation_bytes
    # every matmul split in two (the projections by column or row, attention by head, the head by vocabulary),
    # counted on the rank's shards rather than on the DTensors' whole shapes
    assert (2 * split.fwd_flops, 2 * split.bwd_flops) == (alone.fwd_flops, alone.bwd_flops)
    # loss parallelism: the logits stay split by vocabulary through the cross-entropy, never whole on a rank (at a
    # vocabulary large enough for the head to matter)
    wide = ("trainer.tensor_parallel=2", "model.vocab_size=4096")
    assert estimate(*wide).head_bytes < estimate(*wide, "trainer.loss_parallel=false").head_bytes
    with pytest.raises(ValueError, match="loss=chunked reads the head's weight directly"):
        estimate("trainer.tensor_parallel=2", loss="chunked")


def test_tensor_parallel_collectives_are_costed_on_the_gpu_link_in_full() -> None:
    """One rank of TP 2 + SP sends, per layer, half of each of its 8 sequence all-gathers and reduce-scatters (4 in
    forward, their duals in backward) of a (B, T, C) activation, the embedding's and the final norm's pairs, half the
    head's gathered logits and each norm's weight gradient all-reduced; the step-time model puts those bytes on the
    GPU link, exposed in full. Without TP there are none. With loss parallelism the logits are not gathered (the
    loss's own all-reduces, of one value per token, run inside torch's loss handlers, unseen by the op counter)."""
    from trainer.estimate import measure, open_session
    from trainer.measure.gpus import find_gpu
    from trainer.measure.time.roofline import gpu_speed
    from trainer.policies import build_policy

    B, S, C, V, L = 2, 32, 64, 256, 2

    def work(tp: int, loss_parallel: bool = False) -> Any:
        config = compose_config(
            [
                "model=llama-tiny",
                f"model.n_layer={L}",
                f"model.n_embd={C}",
                "model.n_head=4",
                "model.mlp_hidden=128",
                "trainer=fsdp2",
                "trainer.devices=2",
                f"trainer.tensor_parallel={tp}",
                "precision=32-true",
                f"seq_len={S}",
                f"batch_size={B}",
                f"trainer.loss_parallel={loss_parallel}",
            ]
        )
        session = open_session(config, "cpu")
        try:
            return measure(session, build_policy("none")).work
        finally:
            session.close()

    split, alone, split_loss = work(2), work(1), work(2, loss_parallel=True)
    activation = B * S * C * 4  # one (B, T, C) fp32 activation
    norms = (2 * L + 1) * C * 4  # each SP norm's weight gradient, all-reduced (a sequence shard's sum on each rank)
    logits = B * S * V * 4 // 2  # the head's half of the (B·T, V) fp32 logits, all-gathered
    expected = L * 8 * activation // 2 + 4 * activation // 2 + logits + norms
    assert 0 <= split.tensor_parallel_bytes - expected < 64, (split.tensor_parallel_bytes, expected)
    assert split_loss.tensor_parallel_bytes == split.tensor_parallel_bytes - logits
    assert alone.tensor_parallel_bytes == 0
    speed = gpu_speed(find_gpu("H100-80GB"))
    t = speed.predict(split)  # FSDP2 over 1 rank (TP takes both devices): TP's collectives alone
    assert split.collectives.sent_bytes == 0
    assert (
        t.exposed_collective_ms == t.collective_ms == pytest.approx(split.tensor_parallel_bytes / speed.gpu_link * 1e3)
    )


def test_a_hugging_face_model_splits_by_its_own_plan_without_sequence_parallelism(hf_models: dict[str, Path]) -> None:
    """transformers' base_model_tp_plan (Llama's) is the plan: its colwise/rowwise projections split, the norms and
    head whole; its plans carry no SP, so SP on is one line; a family without a plan (GPT-2) is one line."""
    llama = ["model=hf", f"model.name_or_path={hf_models['llama']}", "seq_len=32"]
    with pytest.raises(ConfigError, match="base_model_tp_plan has no sequence parallelism; set trainer.sequence_par"):
        build.module(
            _config(*llama, "trainer.tensor_parallel=2"),
            vocab_size=320,
            hf_config=build.resolve(_config(*llama), "cpu").hf_config,
        )
    config = _config(*llama, "trainer.tensor_parallel=2", "trainer.sequence_parallel=false")
    module = build.module(config, hf_config=build.resolve(config, "cpu").hf_config)
    plan = module.adapter.tensor_parallel_plan(False)
    assert type(plan["model.layers.*.self_attn.q_proj"]).__name__ == "ColwiseParallel"
    assert type(plan["model.layers.*.mlp.down_proj"]).__name__ == "RowwiseParallel"
    assert {type(plan[k]).__name__ for k in ("model.norm", "lm_head", "model.layers.0.input_layernorm")} == {
        "Replicated"
    }
    gpt2 = ["model=hf", f"model.name_or_path={hf_models['gpt2']}", "seq_len=32", "trainer.tensor_parallel=2"]
    config = _config(*gpt2, "trainer.sequence_parallel=false")
    with pytest.raises(ConfigError, match="GPT2LMHeadModel has no tensor-parallel plan"):
        build.module(config, hf_config=build.resolve(config, "cpu").hf_config)


def test_sequence_parallel_off_lets_any_sequence_length_through() -> None:
    config = _config("trainer.tensor_parallel=4", "model.n_kv_head=4", "seq_len=30", "trainer.sequence_parallel=false")
    assert build.module(config, vocab_size=256).sequence_parallel is False
    assert build.resolve(config, "cpu").world == 1 and build.resolve(config, "cpu").tensor_parallel == 4
