"""Pipeline stages (trainer/parallel/pipeline.py): a native decoder pruned to consecutive stages and driven by torch's
own schedules on 2 gloo processes trains as one process does over the same micro-batches."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import SMALL, run_cli
from trainer.errors import ConfigError
from trainer.interpreter import lean_exit

VOCAB, T, B, MICRO = 64, 16, 2, 4


def _model(family: str, n_layer: int = 4, tie: bool = False) -> torch.nn.Module:
    from models.gpt import GPT, GPTConfig
    from models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    if family == "gpt":
        return GPT(GPTConfig(VOCAB, T, n_layer, 4, 32, dropout=0.0, tie_embeddings=tie, attention="eager"))
    shape = dict(n_embd=32, n_head=4, n_kv_head=2, mlp_hidden=64)
    return Llama(LlamaConfig(VOCAB, T, n_layer, dropout=0.0, tie_embeddings=tie, attention="eager", **shape))  # type: ignore[arg-type]


def _reference(family: str, x: torch.Tensor, y: torch.Tensor) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the micro-batches one after the other, each loss's backward accumulated, the sum divided by their
    number (what the schedules do: backward per micro-batch, then scale_grads)."""
    from models.adapter import adapter_for
    from trainer.loss import LossConfig, head_loss

    model = _model(family)
    adapter = adapter_for(model)
    losses = []
    for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO), strict=True):
        loss = head_loss(adapter.hidden(xm), adapter.head, ym, LossConfig(), adapter.logit_transform)
        loss.backward()
        losses.append(loss.item())
    grads = {}
    for n, p in model.named_parameters():
        assert p.grad is not None
        grads[n] = p.grad.div_(MICRO)
    return grads, losses


def _worker(rank: int, world: int, store: str, out: str) -> None:
    lean_exit()  # a spawned rank: its exit skips the last full collection
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from trainer.loss import LossConfig
    from trainer.parallel.pipeline import PipelineStageModule, build_schedule, prune_to_stage, stage_loss
    from trainer.policies import apply_policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(1)
        x, y = (torch.randint(0, VOCAB, (MICRO * B, T), generator=g) for _ in range(2))
        report: dict[str, Any] = {}
        for family in ("gpt", "llama"):
            reference, ref_losses = _reference(family, x, y)
            for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
                for policy in ("none", "full"):
                    n_stages = world * virtual
                    ids = [rank + world * v for v in range(virtual)]  # interleaved: rank r holds r, r + world, …
                    modules, names = [], {}
                    for s in ids:
                        model = _model(family)
                        names.update({id(p): n for n, p in model.named_parameters()})  # global names, kept by id
                        apply_policy(prune_to_stage(model, s, n_stages), policy)
                        modules.append(PipelineStageModule(model))
                    cpu = torch.device("cpu")
                    stages = [PipelineStage(m, s, n_stages, cpu) for m, s in zip(modules, ids, strict=True)]
                    last = modules[ids.index(n_stages - 1)] if n_stages - 1 in ids else modules[0]
                    sched = build_schedule(schedule, stages, MICRO, stage_loss(last, LossConfig()))
                    losses: list[torch.Tensor] = []
                    if 0 in ids:
                        sched.step(x)
                    else:
                        sched.step(target=y, losses=losses)
                    held = {names[id(p)]: p.grad for m in modules for p in m.parameters()}
                    report[f"{family} {schedule} {policy}"] = {
                        "held": sorted(held),
                        "unequal": sorted(n for n, grad in held.items() if not torch.equal(grad, reference[n])),
                        "losses": [loss.item() for loss in losses],
                        "reference_losses": ref_losses,
                    }
        Path(out, f"{rank}.json").write_text(json.dumps(report))
        dist.barrier()  # neither rank tears gloo down while the other is still in a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_stages_on_two_processes_train_as_one_process_under_each_schedule(tmp_path: Path) -> None:
    """GPT and LLaMA (4 layers) cut into 2 stages (4 virtual stages for interleaved 1F1B) on 2 gloo ranks, one step of
    4 micro-batches under torch's GPipe, 1F1B and interleaved 1F1B, with `none` and with `full` on every stage: each
    rank's gradients equal one process's, accumulated over the same micro-batches, bit for bit; the last stage's
    losses are the micro-batches' losses; between them the ranks hold every parameter once."""
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, tempfile.mktemp(dir=tmp_path), str(tmp_path)), nprocs=2)
    reports = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for case in reports[0]:
        first, last = reports[0][case], reports[1][case]
        assert first["unequal"] == [] and last["unequal"] == [], case
        assert last["losses"] == last["reference_losses"], case
        held = first["held"] + last["held"]
        assert len(held) == len(set(held)) == len(set(held) | set(_model(case.split()[0]).state_dict())), case


def test_stages_hold_their_layers_and_their_ends() -> None:
    """Stage 0 of 2 keeps the embedding and the first half of the layers, stage 1 the second half, the final norm and
    the head; each runs through the model's own forward (token ids in, or the stream), and the stages' parameter
    counts add up to the model's."""
    from trainer.parallel.pipeline import PipelineStageModule, prune_to_stage, stage_layers

    assert stage_layers(4, 2, 1) == range(2, 4)
    whole = _model("llama")
    first, last = prune_to_stage(_model("llama"), 0, 2), prune_to_stage(_model("llama"), 1, 2)
    assert last.model.embed_tokens is None and first.model.norm is None and first.lm_head is None
    assert [len(first.layers), len(last.layers)] == [2, 2]
    gpt = [prune_to_stage(_model("gpt"), s, 2) for s in range(2)]
    assert sum(m.num_parameters(exclude_embeddings=True) for m in gpt) == _model("gpt").num_parameters(True)
    x = torch.randint(0, VOCAB, (B, T))
    with torch.no_grad():
        stream = PipelineStageModule(first)(x)
        assert torch.equal(PipelineStageModule(last)(stream), whole(x, hidden_only=True))


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda: _prune("llama", 3), "cannot split model.n_layer=4 evenly"),
        (lambda: _prune("gpt", 2, tie=True), "set model.tie_embeddings=false"),
        (lambda: _schedule("zero_bubble"), "choose one of gpipe, 1f1b, interleaved_1f1b"),
    ],
)
def test_a_pipeline_that_cannot_be_built_is_one_line(call: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as e:
        call()
    assert "\n" not in str(e.value)


def _prune(family: str, n_stages: int, tie: bool = False) -> Any:
    from trainer.parallel.pipeline import prune_to_stage

    return prune_to_stage(_model(family, tie=tie), 0, n_stages)


def _schedule(name: str) -> Any:
    from trainer.parallel.pipeline import build_schedule

    return build_schedule(name, [], 4, None)


BYTES_CASES = [
    (f, s, v, p)
    for f in ("gpt", "llama")
    for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))
    for p in ("none", "full")
]


def _measured_peak(
    build: Any,
    rank: int,
    world: int,
    schedule: str,
    virtual: int,
    policy: Any,
    loss: Any,
    x: torch.Tensor,
    y: torch.Tensor,
) -> int:
    """This rank's steady-state step on the real process group, `build()` making the whole model, counted by the
    live-tensor tracker as a run counts it."""
    from trainer.measure.memory.tracker import LiveTensorTracker
    from trainer.parallel.pipeline import (
        PipelineStageModule,
        build_schedule,
        pipeline_stage,
        prune_to_stage,
        stage_layers,
        stage_loss,
        stage_policy,
        step_rank,
    )
    from trainer.policies import apply_policy

    n_stages, ids = world * virtual, [rank + world * v for v in range(virtual)]
    modules = []
    for s in ids:
        model = build()
        n_layer = len(model.layers)
        layers = stage_layers(n_layer, n_stages, s)
        apply_policy(prune_to_stage(model, s, n_stages), stage_policy(policy, n_layer, layers, "eager"))
        modules.append(PipelineStageModule(model))
    hidden = modules[0].model.config.n_embd
    stages = [pipeline_stage(m, s, n_stages, (B, T), hidden, torch.float32) for m, s in zip(modules, ids, strict=True)]
    last = modules[ids.index(n_stages - 1)] if n_stages - 1 in ids else modules[0]
    sched = build_schedule(schedule, stages, MICRO, stage_loss(last, loss))
    for _ in range(2):  # the second step is the steady state
        for m in modules:
            m.zero_grad(set_to_none=True)
        with LiveTensorTracker() as tracker:
            step_rank(sched, ids, n_stages, x, y)
    return tracker.peak_bytes


# A configuration as a user writes it: `python -m trainer.estimate` with these overrides prints each rank's peaks.
CONFIGURED = [
    "model=llama-tiny",
    "model.n_layer=4",
    f"seq_len={T}",
    f"batch_size={B}",
    f"accum={MICRO}",
    "trainer.devices=2",
    "trainer.pipeline_parallel=2",
    "policy=per_block",
    "policy.blocks=[full,none,none,full]",  # the whole model's blocks: each stage runs its slice
    "precision=32-true",
]


def _bytes_worker(rank: int, world: int, store: str, out: str) -> None:
    lean_exit()
    import torch.distributed as dist

    from models import build_model
    from trainer.core.schema import compose_config, model_vocab
    from trainer.loss import LossConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(1)
        x, y = (torch.randint(0, VOCAB, (MICRO * B, T), generator=g) for _ in range(2))
        report = {}
        for family, schedule, virtual, policy in BYTES_CASES:
            build = functools.partial(_model, family)
            peak = _measured_peak(build, rank, world, schedule, virtual, policy, LossConfig(), x, y)
            report[f"{family} {schedule} {policy}"] = peak
        # CONFIGURED, its model built from the composed config as the estimator builds it
        config = compose_config(CONFIGURED)
        vocab = model_vocab(config)
        assert vocab is not None
        build = functools.partial(build_model, config.model, vocab)
        report["configured"] = _measured_peak(build, rank, world, "1f1b", 1, config.policy, config.loss, x, y)
        Path(out, f"{rank}.json").write_text(json.dumps(report))
        dist.barrier()  # neither rank tears gloo down while the other is still in a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_each_pipeline_rank_is_estimated_to_the_byte(tmp_path: Path) -> None:
    """Each rank of a 2-rank pipeline (GPT and LLaMA, 4 layers; GPipe, 1F1B, interleaved 1F1B over 4 virtual stages;
    `none` and `full`), its steady-state step's peak as the live-tensor tracker counts it on gloo, equals the estimate
    of that rank alone on fake tensors with torch's fake process group, to the byte; and under 1F1B the first rank,
    whose micro-batches wait longest for their backward, peaks above the last."""
    import torch.multiprocessing as mp

    from trainer.estimate.pipeline import estimate_rank

    mp.spawn(_bytes_worker, args=(2, tempfile.mktemp(dir=tmp_path), str(tmp_path)), nprocs=2)
    measured = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for family, schedule, virtual, policy in BYTES_CASES:
        case = f"{family} {schedule} {policy}"
        for rank in range(2):
            est = estimate_rank(
                lambda f=family: _model(f), rank, 2, schedule, MICRO, (B, T), policy, virtual=virtual
            ).peak
            assert est == measured[rank][case], (case, rank, est, measured[rank][case])
    assert all(measured[0][f"{f} 1f1b none"] > measured[1][f"{f} 1f1b none"] for f in ("gpt", "llama"))
    # the estimator's command on the same configuration: each rank's printed peak is the one that rank measured
    from trainer.estimate.cli import main as estimate_main

    out = tmp_path / "estimate.json"
    assert estimate_main([*CONFIGURED, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["peak"] for r in doc["per_rank"]] == [measured[r]["configured"] for r in range(2)]
    assert [r["layers"] for r in doc["per_rank"]] == [[[0, 2]], [[2, 4]]]


def test_the_first_stage_holds_what_korthikanti_says_at_gpt3_width() -> None:
    """Korthikanti et al. 2022, §4.2.3, at GPT-3's layer (h 12288, 96 heads, s 2048, micro-batch 1, m = 8
    micro-batches): under 1F1B the first stage keeps p micro-batches of its L/p layers in flight, so it holds the
    activations of one micro-batch through all L layers whatever p is; the interleaved schedule (v = 2 model chunks a
    rank) multiplies that by 1 + (p − 1)/(p·v); GPipe keeps all m micro-batches, m/p times it. The formulas count the
    layers only, so each figure is the difference between a 16- and an 8-layer model (the first rank's activations:
    its step's peak without the gradients, on fake tensors), which leaves out the embedding, the head and the P2P
    buffers; against one micro-batch through the whole model (one stage), exactly."""
    from models.gpt import GPT, GPTConfig
    from trainer.estimate.pipeline import estimate_rank

    m, shape = 8, (1, 2048)

    def layers8(*args: Any, **kwargs: Any) -> int:
        """The first rank's activations of a 16-layer GPT-3 less those of an 8-layer one: 8 layers' worth."""

        def gpt3(n_layer: int) -> Any:
            return lambda: GPT(GPTConfig(51200, 2048, n_layer, 96, 12288, dropout=0.0, tie_embeddings=False))

        return (
            estimate_rank(gpt3(16), 0, *args, **kwargs).activations
            - estimate_rank(gpt3(8), 0, *args, **kwargs).activations
        )

    whole = layers8(1, "1f1b", 1, shape)
    for p in (2, 4):
        assert layers8(p, "1f1b", m, shape) == whole, p
        assert layers8(p, "interleaved_1f1b", m, shape, virtual=2) * 2 * p == whole * (2 * p + p - 1), p
    assert layers8(2, "gpipe", m, shape) * 2 == whole * m


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["accum=1"], "needs at least 2 micro-batches a step; accum=1 gives 1: set accum=2 or more"),
        (["model.n_layer=3"], "pipeline_parallel=2 × trainer.pipeline_virtual=1 stages cannot split model.n_layer=3"),
        (["trainer.pipeline_virtual=2"], "only trainer.pipeline_schedule=interleaved_1f1b runs"),
        (["trainer.pipeline_schedule=interleaved_1f1b", "trainer.pipeline_virtual=2", "accum=5"], "multiple of 2"),
        (["trainer.pipeline_schedule=zero_bubble"], "choose one of gpipe, 1f1b, interleaved_1f1b"),
        (["trainer.devices=3"], "trainer.devices=3 does not split into 2 stages' ranks"),
        (["model=tiny"], "set model.tie_embeddings=false"),
        (["trainer=fsdp2"], "not run or estimated yet; use trainer=ddp"),
        (["trainer=fsdp"], "trainer.strategy=fsdp or tensor parallelism is not run or estimated yet"),
        (["trainer.num_nodes=2"], "on one node yet: set trainer.num_nodes=1"),
        (["--autocast-cache"], "--autocast-cache does not take pipeline stages yet"),
        (["trainer.compile=true"], "drop trainer.compile"),
        (["policy=auto", "policy.budget_mib=10"], "not auto or memory_budget"),
        (["precision=bf16-mixed"], "add precision=32-true"),
        (["--fit"], "--fit does not take pipeline stages yet"),
        (["--gpu", "H100-80GB"], "--gpu does not take pipeline stages yet"),
    ],
)
def test_a_pipeline_the_estimate_cannot_take_is_one_line(
    overrides: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad input or what the pipeline estimate does not cover yet: one line naming the fix, nothing estimated."""
    from trainer.estimate.cli import main as estimate_main

    other_policy = any(o.startswith("policy=") for o in overrides)  # CONFIGURED's plan is per_block's own key
    base = [o for o in CONFIGURED if not (other_policy and o.startswith("policy."))]
    assert estimate_main([*base, *overrides]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and says in captured.err, captured.err


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["model.n_layer=3"], "stages cannot split model.n_layer=3 evenly"),
        (["accum=1"], "needs at least 2 micro-batches a step; accum=1 gives 1: set accum=2 or more"),
        (["trainer.devices=3"], "set trainer.devices to a multiple of 2"),
        (["precision=bf16-mixed"], "runs in fp32 only yet, not precision=bf16-mixed: set precision=32-true"),
        (["trainer.pipeline_schedule=zb"], "trainer.pipeline_schedule=zb: choose one of"),
    ],
)
def test_a_pipeline_run_that_cannot_be_made_is_one_line_and_writes_nothing(
    tmp_path: Path, overrides: list[str], says: str
) -> None:
    """train.py settles a configuration through the same refusals as the estimate, before any data is read."""
    from trainer.core.run import train
    from trainer.core.schema import compose_config

    run_dir = tmp_path / "run"
    base = [o for o in CONFIGURED if not o.startswith("policy")]
    with pytest.raises(ConfigError, match=says) as e:
        train(compose_config([*base, "policy=full", *overrides]), run_dir)
    assert "\n" not in str(e.value) and not run_dir.exists()


# train.py over 2 pipeline ranks: GPT (micro) in 2 stages of one layer, 1F1B over 2 micro-batches a step
TRAINED = [
    *SMALL,
    "model.tie_embeddings=false",
    "batch_size=2",
    "accum=2",
    "precision=32-true",
    "trainer.val_every_n_steps=2",
    "measure.warmup_steps=1",
    "measure.activation_every_n_steps=2",
]
STAGES = ["trainer.devices=2", "trainer.pipeline_parallel=2"]


def _step_losses(run_dir: Path) -> dict[int, float]:
    from tests.test_reliability import step_losses

    return step_losses(run_dir)


@pytest.mark.slow
def test_two_pipelines_side_by_side_train_as_ddp_and_each_rank_is_its_prediction(tmp_path: Path) -> None:
    """Dropout off, `python train.py ... trainer.devices=4 trainer.pipeline_parallel=2`: 2 stages (1F1B) × 2
    data-parallel replicas on 4 gloo processes train as DDP over 2 ranks does over the same shards of the same
    batches: each step's loss and the validation loss equal to float rounding (the schedule sums the micro-batches'
    gradients and scales once, Lightning scales each; the replicas average by all-reduce, as DDP). Each rank's
    activation peak and whole-step peak, measured on its tracked step, are its own prediction (the estimate of its
    stages at fit start, AdamW's update included) to the byte; replicas hold equal weights. The checkpoint is the
    whole model, under DDP's own keys."""
    # 4 micro-batches a step and 2 validation batches: validation reads micro-batches, not a step's batch
    common = [*TRAINED, "model.dropout=0.0", "trainer.max_steps=2", "accum=4"]
    ddp, staged = tmp_path / "ddp", tmp_path / "staged"
    r = run_cli(*common, "trainer.strategy=ddp", "trainer.devices=2", f"hydra.run.dir={ddp}")
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli(
        *common, "trainer.devices=4", "trainer.pipeline_parallel=2", "measure.predict=true", f"hydra.run.dir={staged}"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    want, got = _step_losses(ddp), _step_losses(staged)
    assert sorted(got) == sorted(want) == [1, 2]
    assert all(abs(got[s] - want[s]) <= 1e-6 * want[s] for s in want), (got, want)
    a, b = (json.loads((d / "summary.json").read_text()) for d in (ddp, staged))
    assert abs(b["final_val_loss"] - a["final_val_loss"]) <= 1e-6 * a["final_val_loss"]
    assert b["world_size"] == 4 and b["model"]["n_layer"] == a["model"]["n_layer"] == 2
    ranks = b["per_rank"]
    for rank in ranks:
        assert rank["activation_peak_mib"] == rank["predicted_activation_peak_mib"] > 0, rank
        assert rank["peak_total_mib"] == rank["predicted_peak_total_mib"] > rank["activation_peak_mib"], rank
    sums = [r["param_checksum"] for r in ranks]  # ranks 0, 1: the first stage's replicas; 2, 3: the last's
    assert sums[0] == sums[1] != sums[2] == sums[3]
    assert b["activation_peak_error"] == 0.0 and b["peak_total_error"] == 0.0, b
    whole = torch.load(staged / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    mine = torch.load(ddp / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert sorted(whole) == sorted(mine)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ["accum=3"],
        ["accum=6", "model.n_layer=4", "trainer.pipeline_schedule=interleaved_1f1b", "trainer.pipeline_virtual=2"],
    ],
    ids=["1f1b", "interleaved"],
)
def test_trainer_check_compares_a_policy_on_stages_and_the_stages_with_one_process(layout: list[str]) -> None:
    """`python -m trainer.check` on 2 pipeline ranks (1F1B over 3 micro-batches; interleaved 1F1B, 4 stages of one
    layer over 6), dropout on: `full` against `none`, both cut into stages as the run cuts them, bit for bit; and
    `none` in stages against one process, dropout off, within the layout tolerance and not bit for bit (a 3-way mean
    scales in another order)."""
    from trainer.check.compare import LAYOUT_TOLERANCE, run_check
    from trainer.core.schema import compose_config

    config = compose_config([*TRAINED, *STAGES, *layout, "model.dropout=0.1", "policy=full"])
    result = run_check(config, steps=2)
    assert result.equal and result.exact and result.policy == "full", result.first_failure
    tensors = 5 + 12 * config.model.n_layer  # micro's every tensor (embeddings, final norm, head; 12 a layer)
    assert sum(d.params for d in result.groups.values()) == tensors  # from both ranks
    assert result.layout is not None and result.layout.equal
    assert 0 < max(d.max_rel for d in result.layout.groups.values()) < LAYOUT_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("layout", [STAGES, ["trainer.strategy=ddp", "trainer.devices=2"]], ids=["stages", "ddp"])
def test_a_run_of_two_ranks_resumes_exactly_with_each_ranks_dropout(tmp_path: Path, layout: list[str]) -> None:
    """Dropout on (a pipeline rank draws its own stages' masks), 4 steps with a checkpoint every 2; resumed from the
    step-2 checkpoint in a new folder, the last 2 steps' losses and the final weights are the uninterrupted run's
    exactly: each rank's stages (or replica), AdamW state, RNG and the data's position come back (data-parallel
    ranks each within their own share). What cannot resume it (one process, another model, other rows a step) is
    refused in one line (stages)."""
    common = [*TRAINED, *layout, "model.dropout=0.1", "trainer.max_steps=4", "trainer.checkpoint_every_n_steps=2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    r = run_cli(*common, f"hydra.run.dir={straight}")
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli(*common, f"ckpt_path={straight / 'checkpoints' / 'step000002.ckpt'}", f"hydra.run.dir={resumed}")
    assert r.returncode == 0, r.stderr[-2000:]
    want, got = _step_losses(straight), _step_losses(resumed)
    assert sorted(got) == [3, 4] and all(got[s] == want[s] for s in got), (got, want)
    a, b = (torch.load(d / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"] for d in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if layout != STAGES:
        return
    # what the ranks cannot resume is one line before any rank starts, no folder: one process (the stages' RNG and
    # optimizer state), another model (a rank would miss its keys), a step of other rows (the data's position)
    last = f"ckpt_path={straight / 'checkpoints' / 'last.ckpt'}"
    for args, says in [
        (TRAINED, "resume it with the same trainer.pipeline_parallel"),
        ([*common, "model.n_layer=4"], "holds another model's weights"),
        ([*common, "accum=4"], "was trained on batches of 4 rows, this run's have 8"),
    ]:
        elsewhere = tmp_path / "elsewhere"
        r = run_cli(*args, last, f"hydra.run.dir={elsewhere}")
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr[-2000:]
        assert not elsewhere.exists()


def test_the_ranks_together_run_the_flops_of_one_process() -> None:
    """The step-time model prices each rank's own ops (its step on fake tensors, traced op by op): over the ranks of
    every schedule they are the FLOPs of the whole model running the same micro-batches in one process, `full`'s
    recompute included, so cutting the model into stages neither loses nor repeats compute."""
    from trainer.estimate.pipeline import estimate_rank

    def flops(world: int, rank: int, schedule: str, virtual: int = 1) -> int:
        work = estimate_rank(
            lambda: _model("llama"), rank, world, schedule, MICRO, (B, T), "full", virtual=virtual
        ).work
        assert work is not None
        return work.flops

    whole = flops(1, 0, "1f1b")
    for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        assert sum(flops(2, rank, schedule, virtual) for rank in range(2)) == whole, schedule


def test_a_per_block_plan_names_the_whole_models_blocks_and_each_stage_takes_its_own() -> None:
    """policy=per_block on 2 stages: blocks [full, full, none, none] of the whole model put `full` on the first stage's
    two layers and `none` on the second's, so each rank's peak is that uniform policy's on the rank; a plan the length
    of a stage, not the model, is one line."""
    from trainer.errors import PolicyError
    from trainer.estimate.pipeline import estimate_rank

    def peak(rank: int, policy: Any) -> int:
        return estimate_rank(lambda: _model("llama"), rank, 2, "1f1b", MICRO, (B, T), policy).peak

    plan = {"name": "per_block", "blocks": ["full", "full", "none", "none"]}
    assert peak(0, plan) == peak(0, "full") and peak(1, plan) == peak(1, "none")
    assert peak(0, "full") < peak(0, "none")  # the plan is not the same policy on both stages
    with pytest.raises(PolicyError, match="policy.blocks has 2 entries but the model has 4 blocks"):
        peak(0, {"name": "per_block", "blocks": ["full", "none"]})


def test_a_budget_finds_each_ranks_fewest_recomputed_layers(tmp_path: Path) -> None:
    """--budget with stages: per rank, the fewest leading layers recomputed whole (the rest kept) whose total (the
    whole step's peak as train.py takes it, AdamW's update included) fits; the plan they make, estimated as the user
    would run it, fits on every rank with those totals, and one layer fewer on a rank that recomputes any does not."""
    from trainer.estimate.cli import main as estimate_main

    def totals(*args: str) -> dict[str, Any]:
        out = tmp_path / "e.json"
        assert estimate_main([*CONFIGURED, "--no-time", *args, "--json", str(out)]) == 0
        return json.loads(out.read_text())

    # between CONFIGURED's `full` and `none` totals on both ranks
    full, none = (
        [r["total"] for r in totals(f"policy.blocks=[{p},{p},{p},{p}]")["per_rank"]] for p in ("full", "none")
    )
    assert max(full) < min(none)
    budget = (max(full) + min(none)) // 2

    fit = totals("--budget", f"{budget}")["fit"]
    assert all(r["fits"] and r["recomputed"] > 0 for r in fit["ranks"]), fit  # the budget is between, on both
    chosen = totals("policy=per_block", f"policy.blocks=[{','.join(fit['plan'])}]")
    assert [r["total"] for r in chosen["per_rank"]] == [r["total"] for r in fit["ranks"]]
    assert all(r["total"] <= budget for r in chosen["per_rank"])
    for r in fit["ranks"]:  # minimal: no rank fits with one layer fewer recomputed
        if r["recomputed"]:
            fewer = list(fit["plan"])
            fewer[2 * r["rank"] + r["recomputed"] - 1] = "none"  # 2 layers a rank
            rank_total = totals("policy=per_block", f"policy.blocks=[{','.join(fewer)}]")["per_rank"][r["rank"]][
                "total"
            ]
            assert rank_total > budget, r
