"""trainer.compile=true: what the compiled step allocates, counted two independent ways, and the policies that must
compile at all."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.cpu_counter import CpuAllocationCounter
from trainer import precision as precision_
from trainer.core import build, step
from trainer.core.schema import compose_config
from trainer.measure.memory.tracker import LiveTensorTracker
from trainer.policies import build_policy


def test_under_a_dispatch_mode_dynamo_runs_the_compiled_frame_eagerly() -> None:
    """Why a compiled step is not counted with the live-tensor tracker: while its dispatch mode is pushed, dynamo
    runs the frame's Python, not its compiled graph (the backend's graph is never called)."""
    calls = {"graph": 0}

    def backend(gm: torch.fx.GraphModule, example: list[torch.Tensor]) -> object:
        def run(*args: torch.Tensor) -> object:
            calls["graph"] += 1
            return gm.forward(*args)

        return run

    f = torch.compile(lambda x: (x * 2).sin(), backend=backend)
    x = torch.randn(8)
    f(x)
    assert calls["graph"] == 1
    with LiveTensorTracker():
        f(x)
    assert calls["graph"] == 1  # the compiled graph did not run


@pytest.fixture(autouse=True)
def _compiled_for_real() -> Iterator[None]:
    """Many compiled modules of one class in one process: past dynamo's recompile limit a frame would silently run
    eagerly, so the limit is raised, and hitting it fails the test instead."""
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        yield


@pytest.fixture(scope="module")
def counter() -> Iterator[CpuAllocationCounter]:
    c = CpuAllocationCounter()  # built once per machine (a C++ extension), then cached
    c.install()
    yield c
    c.uninstall()


SHAPES = ["seq_len=32", "batch_size=2", "precision=32-true", "model.dropout=0.0"]
MODELS = {"gpt": ["model=micro", "model.attention=eager"], "llama": ["model=llama-tiny", "model.n_layer=2"]}


def _measured(config_overrides: list[str], policy: Any, counter: CpuAllocationCounter | None) -> dict[str, int]:
    """A compiled (or eager) module's third step, metered as a run meters it; with `counter`, counted a second way
    over the same step."""
    config = compose_config(config_overrides)
    chosen, _ = precision_.resolve(config.precision, "cpu")
    torch.manual_seed(0)
    module = build.module(config, policy, precision=chosen).train()
    module.configure_model()  # compiles under trainer.compile=true, as Lightning's setup does
    opt, sched = step.optimizers_of(module)
    plugin = precision_.plugin(chosen, "cpu")
    vocab = module.adapter.head.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    shape = (config.batch_size, config.seq_len)
    batch = (torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
    for _ in range(2):  # compile, then a warm step: AdamW's state and last step's gradients exist
        step.bare_step(module, [batch], opt, sched, plugin)
    meter = step.StepMeter("cpu", compiled=config.trainer.compile)
    if counter is not None:
        counter.start([t for ts in step.training_state(module, [opt]).values() for t in ts])
    mark = (lambda: counter.mark("window_end")) if counter is not None else None
    step.bare_step(module, [batch], opt, sched, plugin, meter=meter, before_update=mark)
    figures = meter.end(module)
    out = {"activation": figures.activation_bytes, "total": figures.total_bytes}
    if counter is not None:
        grads = [p.grad for p in module.parameters()]
        rec = counter.stop({"window_end": [g.untyped_storage().data_ptr() for g in grads if g is not None]})
        out["counted_activation"] = rec.peak(rec.records_at("window_end", grads), until="window_end", adopted=False)
        out["counted_total"] = rec.peak()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "full", "op_sac", "selective"])
@pytest.mark.parametrize("family", list(MODELS))
def test_the_compiled_step_is_counted_as_the_allocator_counts_it(
    family: str, policy: str, counter: CpuAllocationCounter
) -> None:
    """Under trainer.compile=true the run's figures (StepMeter(compiled=True): the profiler's memory events) agree
    with a second count taken by wrapping the CPU allocator itself, over the same step; and `none`'s compiled
    figures are not eager's (inductor keeps fewer, fused intermediates).

    The estimator's compiled step (trainer.measure.fake.compiled: inductor's own compilation, its generated code run on
    fake tensors) against the same run: the activation and whole-step peaks to within 1 % (measured: to the byte)."""
    overrides = [*MODELS[family], *SHAPES, "trainer.compile=true"]
    compiled = _measured(overrides, policy, counter)
    assert compiled["activation"] == pytest.approx(compiled["counted_activation"], rel=0.01)
    assert compiled["total"] == pytest.approx(compiled["counted_total"], rel=0.01)
    if policy == "none":
        eager = _measured([*MODELS[family], *SHAPES], policy, None)
        assert compiled["activation"] < eager["activation"]
    est = _estimated([*overrides, f"policy={policy}"])
    assert est.activation_bytes == pytest.approx(compiled["activation"], rel=0.01)
    assert est.peak_bytes == pytest.approx(compiled["total"], rel=0.01)


@pytest.mark.slow
@pytest.mark.skipif(not precision_.cpu_bf16_native()[0], reason="bf16 is emulated on this CPU")
@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("family", list(MODELS))
def test_in_bf16_the_compiled_estimate_counts_what_the_allocator_counts(family: str, policy: str) -> None:
    """bf16-mixed on a CPU with bf16 kernels: the compiled estimate equals the compiled run to the byte. Two things a
    fake step does not do as the run does, both in it: oneDNN's bf16 matmuls take a workspace from the allocator
    (measured once per shape on this CPU), and the autograd engine sums the two gradients of the tied embedding in
    place (on fake tensors it sums out of place, a second buffer). The whole step's peak to within 64 bytes: the
    Python numbers AdamW passes to its ops become 0-dim tensors (8 and 4 bytes) as torch parses the arguments,
    before any dispatch, so no fake step sees them; at these shapes the peak falls among them."""
    # gpt at tiny's width: its tied 256 × 256 embedding's gradient is summed while the activation peak stands
    models = {**MODELS, "gpt": ["model=tiny", "model.n_layer=1"]}
    overrides = [*models[family], *SHAPES, "precision=bf16-mixed", "trainer.compile=true"]
    compiled = _measured(overrides, build_policy(policy), None)
    est = _estimated([*overrides, f"policy={policy}"])
    assert est.activation_bytes == compiled["activation"]
    assert est.peak_bytes == pytest.approx(compiled["total"], abs=64)


def _estimated(overrides: list[str]) -> Any:
    from trainer.estimate import measure, open_session

    config = compose_config(overrides)
    session = open_session(config, "cpu")
    try:
        return measure(session, build_policy(config.policy))
    finally:
        session.close()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "full", "op_sac", "selective"])
def test_a_hugging_face_family_compiled_is_estimated(policy: str, hf_models: dict[str, Any]) -> None:
    """The compiled estimate on a Hugging Face family (GPT-2 through transformers' SDPA): within 1 % of the compiled
    run (measured: to the byte). transformers builds an explicit attention mask while dynamo traces it (on fake
    tensors, in a run too), and inductor saves the CPU generator's state for a recomputed SDPA kernel: both are in
    the estimate. Not in it: on transformers 5.25 a checkpointed Llama layer breaks dynamo's graph, so its checkpoint
    runs eagerly and keeps the CPU RNG state (5,056 B per region) without a dispatched op (docs/estimator.md)."""
    overrides = ["model=hf", f"model.name_or_path={hf_models['gpt2']}", "data.tokenizer=model", *SHAPES]
    compiled = _measured([*overrides, "trainer.compile=true"], policy, None)
    est = _estimated([*overrides, "trainer.compile=true", f"policy={policy}"])
    assert est.activation_bytes == pytest.approx(compiled["activation"], rel=0.01)
    assert est.peak_bytes == pytest.approx(compiled["total"], rel=0.01)


@pytest.mark.parametrize("policy", ["none", "full"])
def test_on_an_eager_step_the_allocator_count_is_the_tracker_count(policy: str, counter: CpuAllocationCounter) -> None:
    """The allocator-side count and the live-tensor tracker see the same eager step alike, but for what no op makes:
    the 0-d tensors Python scalars become (a few bytes) and the CPU RNG state each checkpoint region keeps for its
    recompute (torch.get_rng_state(), made without a dispatched op: the tracker misses it)."""
    tracked = _measured([*MODELS["gpt"], *SHAPES], policy, counter)
    regions = 2 if policy == "full" else 0  # micro: two blocks, one checkpoint each
    rng_state = torch.get_rng_state().numel()
    for figure in ("activation", "total"):
        unseen = tracked[f"counted_{figure}"] - tracked[figure] - regions * rng_state
        assert 0 <= unseen <= 64, (figure, unseen)


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy",
    [{"name": "torchtitan_sac"}, {"name": "op_sac", "save_ops": ["aten.mm", "aten.addmm", "aten.bmm"]}],
    ids=["torchtitan_sac", "op_sac-own-list"],
)
def test_the_guarded_selective_policies_compile(policy: dict[str, object]) -> None:
    """The per-op policies whose contexts carry the in-place guard compile: dynamo calls a checkpoint's context_fn
    unbound and accepts only torch's two SAC modes from it (the guard has nothing to guard in a functional trace)."""

    figures = _measured([*MODELS["gpt"], *SHAPES, "trainer.compile=true"], build_policy(policy), None)
    assert figures["activation"] > 0


@pytest.mark.parametrize("policy", ["op_sac", "torchtitan_sac"])
def test_the_per_op_policies_compile_without_a_graph_break(policy: str) -> None:
    """A per-op policy's checkpoint contexts are made when the policy is, not on their first read inside the traced
    forward: a functools.cached_property takes an RLock there (Python 3.11), which dynamo cannot trace, so every
    block's checkpoint broke the graph and the compiled step was a different, per-block program."""
    from torch._dynamo.utils import counters

    config = compose_config([*MODELS["llama"], *SHAPES, "trainer.compile=true"])
    module = build.module(config, build_policy(policy)).train()
    module.configure_model()
    opt, sched = step.optimizers_of(module)
    vocab = module.adapter.head.weight.shape[0]
    batch = (torch.randint(0, vocab, (2, 32)), torch.randint(0, vocab, (2, 32)))
    counters.clear()
    step.bare_step(module, [batch], opt, sched, precision_.plugin("32-true", "cpu"))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


# ----------------------------------------------------------------------------------------------------
# memory_budget: torch's budget partitioner as a policy.
# ----------------------------------------------------------------------------------------------------


def _dropout_gradients(budget: float) -> list[torch.Tensor]:
    """A dropout MLP compiled under `activation_memory_budget=budget`: its gradients for a fixed seed."""
    from trainer.policies import budget_backend

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Dropout(0.3), torch.nn.Linear(256, 256), torch.nn.GELU()
    )
    x = torch.randn(32, 64)
    compiled = torch.compile(net, backend=budget_backend(budget))  # memory_budget's own backend
    torch.manual_seed(1)
    compiled(x).pow(2).sum().backward()
    return [p.grad.clone() for p in net.parameters()]


@pytest.mark.slow
def test_below_budget_one_this_torch_recomputes_dropout_wrongly_and_the_policy_refuses_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """pytorch issues 190717/190758: below budget 1 the partitioner may recompute a dropout with fresh randomness.
    Reproduced on this torch (budget 0 against budget 1, same seed, both compiled), so memory_budget must refuse a
    model with dropout below 1, in training and in trainer.check; when a torch fixes it, this test says to lift the
    refusal."""
    from trainer.check.compare import main as check_main
    from trainer.errors import PolicyError

    saved, recomputed = _dropout_gradients(1.0), _dropout_gradients(0.0)
    bug = any(not torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(saved, recomputed, strict=True))
    if not bug:
        pytest.fail("this torch recomputes dropout exactly under the budget partitioner: lift MemoryBudget's refusal")
    config = compose_config(["model=micro", "seq_len=32", "model.dropout=0.1", "trainer.compile=true"])
    with pytest.raises(PolicyError, match="190717"):
        build.module(config, {"name": "memory_budget", "budget": 0.5})
    overrides = ["model=micro", "seq_len=32", "batch_size=2", "model.dropout=0.1", "trainer.compile=true"]
    assert check_main([*overrides, "policy=memory_budget", "policy.budget=0.5", "--steps", "1"]) == 2
    assert "190717" in capsys.readouterr().err
    assert build.module(config, {"name": "memory_budget", "budget": 1.0}) is not None  # the default cut saves masks


def test_memory_budget_needs_compile_and_a_budget_in_range() -> None:
    from trainer.errors import PolicyError

    config = compose_config(["model=micro", "seq_len=32", "model.dropout=0.0"])
    with pytest.raises(PolicyError, match="trainer.compile=true"):
        build.module(config, "memory_budget")
    with pytest.raises(PolicyError, match=r"policy.budget=1.5 must be in \[0, 1\]"):
        build_policy({"name": "memory_budget", "budget": 1.5})


@pytest.mark.slow
def test_the_budget_reaches_the_partitioner_and_keeps_gradients_exact() -> None:
    """Budget 0.5 saves less than budget 1 (the compiled step's activation peak drops, on a shape where the blocks'
    activations outweigh the head's), and trainer.check finds its gradients equal to none's, both compiled, within
    the compiled tolerance (no dropout). (Budget 0 can peak above budget 1: the whole graph's recompute runs in one
    backward graph; bench.compiled shows it.)"""
    from trainer.check.compare import run_check

    shape = ["model=llama-tiny", "model.n_layer=2", "seq_len=128", "batch_size=4", "precision=32-true"]
    overrides = [*shape, "model.dropout=0.0", "trainer.compile=true"]
    half = _measured(overrides, {"name": "memory_budget", "budget": 0.5}, None)
    default = _measured(overrides, {"name": "memory_budget", "budget": 1.0}, None)
    assert half["activation"] < 0.8 * default["activation"]
    # The estimator's compiled step runs the same partitioner at the same budget: its figures are the run's.
    from trainer.estimate import measure, open_session

    session = open_session(compose_config(overrides), "cpu")
    try:
        est = {b: measure(session, build_policy({"name": "memory_budget", "budget": b})) for b in (0.5, 1.0)}
    finally:
        session.close()
    for budget, run in ((0.5, half), (1.0, default)):
        assert est[budget].activation_bytes == pytest.approx(run["activation"], rel=0.01)
        assert est[budget].peak_bytes == pytest.approx(run["total"], rel=0.01)
    # the check at the measured shape and budget: its compiled graphs are those compiled above (inductor's caches)
    config = compose_config([*overrides, "policy=memory_budget", "policy.budget=0.5"])
    result = run_check(config, steps=1)
    assert result.equal, result.first_failure


# ----------------------------------------------------------------------------------------------------
# The compiled step's ops for the step-time model: a fused kernel's bytes, once.
# ----------------------------------------------------------------------------------------------------


def _compiled_work(fn: Any, *shapes: tuple[int, ...]) -> Any:
    """`fn` compiled by inductor on fake tensors as the estimator compiles (its generated code run, the kernels
    stand-ins), then run once under the op counter: its Work."""
    import functools

    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainer.measure.fake.compiled import GraphOpTrace, fake_compiled_runtime, run_generated_code

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=functools.partial(compile_fx, inner_compile=run_generated_code))
    with fake_compiled_runtime(), FakeTensorMode():
        args = [torch.empty(s) for s in shapes]
        compiled(*args)  # compiles
        with GraphOpTrace() as counter:
            compiled(*args)
    torch._dynamo.reset()
    return counter.work


def test_a_fused_kernel_is_costed_once_by_the_bytes_it_reads_and_writes() -> None:
    """A pointwise chain inductor fuses into one kernel moves its input once and its output once, where its eager
    ops would move every intermediate; its transcendental math makes it a `math` op."""
    work = _compiled_work(lambda x: (x.sin() * x.cos()).exp(), (256, 1024))
    (key,) = [k for k in work.ops if k.kind != "free"]
    assert work.ops[key] == 1
    assert key.kind == "math" and key.nbytes == 2 * 256 * 1024 * 4


# ----------------------------------------------------------------------------------------------------
# policy=auto under compile: planned on the compiled step, checked against the model compiled whole.
# ----------------------------------------------------------------------------------------------------

AUTO_SHAPE = ["model=llama-tiny", "model.n_layer=2", "seq_len=128", "batch_size=4", "precision=32-true"]


@pytest.mark.slow
def test_auto_under_compile_plans_the_compiled_step_and_the_run_keeps_to_it(tmp_path: Any) -> None:
    """policy=auto with trainer.compile=true: each block profiled as inductor compiles it, the plan checked against
    the model compiled whole (inductor schedules one block's recompute beside another's, so the whole can peak above
    the blocks' sum, or below it) and solved again while it is over; the estimate of the plan fits the budget and is
    the plan's prediction, to the byte. A compiled run of that configuration trains the same plan and measures the
    predicted peak."""
    import json

    from tests.conftest import run_cli
    from trainer.estimate import plan_result_for_config

    base = [*AUTO_SHAPE, "model.dropout=0.0", "trainer.compile=true"]
    # Three candidates (every block compiles under each, here and again in the run): none, the attention core
    # recomputed and the whole block recomputed.
    candidates = ("none", "selective", "full")
    uniform = {p: _estimated([*base, f"policy={p}"]).peak_bytes for p in ("none", "full")}
    budget_mib = (uniform["none"] + uniform["full"]) / 2 / 2**20
    planned = [
        *base,
        "policy=auto",
        f"policy.budget_mib={budget_mib:.3f}",
        f"policy.candidates=[{','.join(candidates)}]",
    ]
    result = plan_result_for_config(compose_config(planned))
    assert result.fits and set(result.treatments) != {"none"}
    est = _estimated([*base, "policy=per_block", f"policy.blocks=[{','.join(result.treatments)}]"])
    assert est.peak_bytes <= budget_mib * 2**20
    assert result.solution.peak == est.peak_bytes  # the plan's prediction is its compiled-whole estimate
    run = run_cli(
        *planned,
        "trainer=smoke",
        "trainer.max_steps=3",
        "trainer.enable_checkpointing=false",
        "trainer.val_every_n_steps=100",
        "measure.warmup_steps=1",
        "measure.activation_every_n_steps=2",
        "measure.predict=false",  # the run's own compiled prediction is test_train's; here the plan's is checked
        f"hydra.run.dir={tmp_path}",
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["auto"]["plan"] == list(result.treatments) and not summary["auto"]["replanned"]
    assert summary["peak_total_mib"] <= budget_mib
    assert summary["peak_total_mib"] == pytest.approx(summary["auto"]["predicted_peak_mib"], rel=0.01)


def test_the_estimator_shows_eager_and_compiled_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    """`--compile-vs-eager`: the configured policy estimated with trainer.compile flipped too, the two printed side
    by side; the compiled figures are the compiled estimate's (the same as `trainer.compile=true` alone)."""
    from trainer.estimate.cli import main as estimate_main

    shape = [*MODELS["gpt"], *SHAPES, "policy=full"]
    assert estimate_main([*shape, "--policies", "configured", "--compile-vs-eager"]) == 0
    out = capsys.readouterr().out
    assert "eager and compiled (trainer.compile=true), side by side:" in out
    (row,) = [line for line in out.splitlines() if line.startswith("| `full` |")]
    compiled = _estimated([*shape, "trainer.compile=true"])
    assert row.split("|")[5].strip() == f"{compiled.peak_bytes / 2**20:.3f}"


def test_the_allocator_recorder_finds_a_sharded_gradient_by_its_local_shard() -> None:
    """A compiled step's activation leaves out the gradients alive at the end of backward; under FSDP2 they are
    DTensors, whose own storage has no data (a compiled FSDP2 run failed at its metered step: 'invalid python
    storage'). The recorder finds each by its local shard."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainer.measure.fake.process_group import fake_mesh, release
    from trainer.measure.memory.allocator_events import AllocatorRecorder

    mesh, group = fake_mesh(2, "cpu")
    try:
        recorder = AllocatorRecorder("cpu")
        recorder.start()
        grad = distribute_tensor(torch.ones(64, 32), mesh, [Shard(0)])  # this rank's (32, 32) shard, made in the window
        with pytest.raises(RuntimeError, match="invalid python storage"):  # no data of its own
            grad.untyped_storage().data_ptr()
        recorder.mark("end", [grad])
        rec = recorder.stop()
        (record,) = rec.records_at("end", [grad, None])
        assert rec.peak(excluding=[record]) == rec.peak() - 32 * 32 * 4
    finally:
        release(group)
