"""`policy=auto`, proven on CPU with tiny shapes: the peak model, the exact solver, the runs, the refusal, gradients.

* The peak model predicts a bare training step's whole peak (LiveTensorTracker with the training state adopted)
  to the byte, for uniform and mixed plans, with and without accumulation.
* The solver is exact: the same optimum as brute force over every plan of a 4-block model, on profiled numbers
  and on random synthetic ones (offload prefetch and accumulation included), at every budget that matters.
* Real runs (`trainer.core.run.train`) stay within the budget at several budgets, with the summary's `auto` record;
  a run whose prediction is made too low re-plans once and then fits.
* Refusal is one line naming a budget that fits and a micro-batch that fits; `plan_for_config` (the estimator's
  hook) and training arrive at the same plan and the same predicted bytes.
* `auto` at several budgets gives the same loss and gradients as `none`, bit for bit (dropout 0.1, bf16
  autocast, accumulation), and planning leaves the RNG and the weights as they were.
"""

from __future__ import annotations

import copy
import functools
import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer import planner
from trainer import precision as precision_
from trainer.core import step as step_
from trainer.core.module import DecoderModule, param_groups
from trainer.core.run import train
from trainer.core.schema import validate
from trainer.estimate import plan_for_config, plan_result_for_config
from trainer.formatting import MIB
from trainer.planner import BOOKKEEPING, Cost, PeakModel, Profile, profiler
from trainer.policies import POLICIES, PolicyError, apply_policy, build_policy, treatments

# ----------------------------------------------------------------------------------------------------
# A 4-block model, profiled once.
# ----------------------------------------------------------------------------------------------------

L, C, H, T, B, V = 4, 32, 2, 32, 2, 64


@functools.cache
def base_module() -> DecoderModule:
    torch.manual_seed(0)
    shape = {"family": "gpt", "block_size": T, "n_layer": L, "n_embd": C, "n_head": H, "dropout": 0.1}
    return DecoderModule({**shape, "attention": "eager"}, "none", vocab_size=V)


def base_model() -> Any:
    return base_module().model


def loss_fn(model: Any) -> Any:
    """The training forward of `model` (a GPT): its loss through the standard head, as DecoderModule.loss_of."""
    return lambda batch: model(*batch)[1]


@functools.cache
def batches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (2, B, T), generator=g), torch.randint(0, V, (2, B, T), generator=g)


def auto_cfg(**kw: Any) -> Any:
    return build_policy({"name": "auto", "budget_mib": 1000.0, **kw}).cfg


@functools.cache
def profiled(accum: int = 1) -> Profile:
    model = copy.deepcopy(base_model())
    idx, tgt = batches()
    return planner.profile(
        model,
        (idx[0], tgt[0]),
        loss_fn=loss_fn(model),
        precision="bf16-mixed",
        make_optimizer=planner.default_optimizer(),
        param_groups=param_groups(model, 0.1),
        accum=accum,
        policy=build_policy({"name": "auto", "budget_mib": 1000.0}),
        grad_clip=1.0,
        repeats=1,
    )


def timed_profile(repeats: int) -> Profile:
    """The 4-block model profiled on real tensors in fp32 with `repeats` timed rounds after one warm-up."""
    model = copy.deepcopy(base_model())
    idx, tgt = batches()
    return planner.profile(
        model,
        (idx[0], tgt[0]),
        loss_fn=loss_fn(model),
        precision="32-true",
        make_optimizer=planner.default_optimizer(),
        repeats=repeats,
        warmup=1,
        policy=build_policy({"name": "auto", "budget_mib": 1000.0}),
    )


def test_real_times_come_from_rounds_and_the_whole_stack() -> None:
    """Timed rounds (more than one) scale the blocks to the whole stack's time under each uniform plan: the profile
    says by how much, and every treatment has a time."""
    prof = timed_profile(repeats=2)
    note = next(n for n in prof.notes if n.startswith("block times scaled to the whole stack's"))
    assert all(f"{t} ×" in note for t in prof.treatments)
    assert all(c.ms > 0 for costs in prof.costs for c in costs.values())


def test_fake_profiles_are_timed_by_the_step_time_model() -> None:
    """On fake tensors a profile's times are the roofline's for the speed given: recompute costs its replayed ops,
    SAC its decisions; the same profile twice gives the same times."""
    from trainer.core.schema import compose_config
    from trainer.estimate import plan_result_for_config
    from trainer.measure.time.roofline import Speed

    speed = Speed(
        name="flat",
        matmul={"fp32": ((1.0, 1e10),)},
        bandwidth={"memory": ((1.0, 1e9),)},
        op_s=1e-6,
        free_s=0.0,
        sac_s=1e-5,
    )
    config = compose_config(["model=micro", "seq_len=32", "precision=32-true", "policy=auto", "policy.budget_mib=1000"])
    first, second = (plan_result_for_config(config, "cpu", fake=True, speed=speed).profile for _ in range(2))
    assert "step times predicted for flat" in first.notes
    c = first.costs[0]
    assert c["full"].bwd_ms > c["none"].bwd_ms and c["op_sac"].bwd_ms > c["none"].bwd_ms
    assert [x.ms for x in c.values()] == [x.ms for x in second.costs[0].values()]


def bare_step_peak(treatments: list[str], accum: int) -> int:
    """A training step as Lightning runs it (trainer.core.step.bare_step), measured from the third step with the
    training state adopted (trainer.core.step.StepMeter): the figure MeasureCallback reports as peak_total."""
    module = copy.deepcopy(base_module())
    apply_policy(module.model, {"name": "per_block", "blocks": treatments})
    module.train()
    opt, sched = step_.optimizers_of(module)
    plugin = precision_.plugin("bf16-mixed", "cpu")
    idx, tgt = batches()
    micro = [(idx[0], tgt[0])] * accum
    for _ in range(2):
        step_.bare_step(module, micro, opt, sched, plugin, grad_clip=1.0)
    meter = step_.StepMeter("cpu")
    step_.bare_step(module, micro, opt, sched, plugin, grad_clip=1.0, meter=meter)
    return meter.end(module).total_bytes


PLANS = [
    ["none"] * L,
    ["selective"] * L,
    ["op_sac"] * L,
    ["full"] * L,
    ["none", "none", "full", "full"],
    ["full", "op_sac", "selective", "none"],
    ["selective", "full", "none", "op_sac"],
]


@pytest.mark.parametrize("accum", [1, 2])
def test_predicted_peak_is_the_measured_peak_to_the_byte(accum: int) -> None:
    prof = profiled(accum)
    model = PeakModel(prof)
    # BOOKKEEPING is headroom for Lightning's scalars; a bare step makes only `loss / accum` and its copy. With
    # accumulation the profile counts gradients it creates although later micro-batches sum into existing ones: the
    # model errs high by at most one block's gradients plus the embedding's and head's.
    slack = BOOKKEEPING + (max(prof.block_grads) + prof.grads - sum(prof.block_grads) if accum > 1 else 0)
    for plan in PLANS:
        predicted = model.evaluate(plan).peak
        measured = bare_step_peak(plan, accum)
        assert 0 <= predicted - measured <= slack, (plan, predicted - measured)
    # the plans really differ
    peaks = {model.evaluate(p).peak for p in PLANS}
    assert len(peaks) >= 5


# ----------------------------------------------------------------------------------------------------
# The solver against brute force.
# ----------------------------------------------------------------------------------------------------


def assert_solver_exact(model: PeakModel, max_budgets: int | None = None) -> int:
    """solve() == brute force at every budget where the answer can change: each distinct predicted peak of any plan
    (or an even sample of them), and one byte below the least (nothing fits). Returns how many budgets had a plan."""
    every = [model.evaluate(c) for c in itertools.product(model.prof.treatments, repeat=model.prof.n_layer)]
    peaks = sorted({s.peak for s in every})
    if max_budgets and len(peaks) > max_budgets:
        peaks = [peaks[round(k * (len(peaks) - 1) / (max_budgets - 1))] for k in range(max_budgets)]
    solved = 0
    for budget in [peaks[0] - 1, *peaks]:
        feasible = [s.step_ms for s in every if s.peak <= budget]
        got = model.solve(budget)
        if not feasible:
            assert got is None, budget
            continue
        assert got is not None and got.peak <= budget, budget
        assert got.step_ms == pytest.approx(min(feasible), rel=1e-12, abs=1e-9), (budget, got)
        solved += 1
    frugal = model.min_peak()  # the most frugal plan, and the fastest of those
    assert frugal.peak == peaks[0]
    assert frugal.step_ms == pytest.approx(min(s.step_ms for s in every if s.peak == peaks[0]), rel=1e-12)
    return solved


@pytest.mark.parametrize("accum", [1, 2])
def test_solver_is_exact_on_the_profiled_4_block_model(accum: int) -> None:
    model = PeakModel(profiled(accum))
    assert model.prof.treatments == ("none", "selective", "op_sac", "full")
    assert assert_solver_exact(model) > 10
    budget = model.evaluate(["op_sac"] * L).peak
    assert model.solve(budget) == model.brute_force(budget) or (
        model.solve(budget).step_ms == pytest.approx(model.brute_force(budget).step_ms)  # type: ignore[union-attr]
    )


def synthetic(
    rng: random.Random, treatments: tuple[str, ...], accum: int, integer_ms: bool, n_layer: int = L
) -> Profile:
    def cost(t: str) -> Cost:
        kept = rng.randint(0, 1000)
        restored = rng.randint(0, 800) if t == "offload" else 0
        ms = (lambda: float(rng.randint(1, 4))) if integer_ms else (lambda: rng.uniform(0.5, 3.0))
        return Cost(
            kept_fwd=kept + rng.randint(0, 200),
            kept=kept,
            fwd_peak=kept + rng.randint(0, 600),
            transient=rng.randint(0, 1500),
            restored=restored,
            fwd_ms=ms(),
            bwd_ms=ms(),
        )

    costs = [{t: cost(t) for t in treatments} for _ in range(n_layer)]
    return Profile(
        treatments=treatments,
        costs=costs,
        block_grads=[rng.randint(0, 300) for _ in range(n_layer)],
        params=rng.randint(0, 500),
        grads=rng.randint(1200, 1500),
        optimizer=rng.randint(0, 1000),
        x_bytes=rng.randint(0, 50),
        embed_fwd_peak=rng.randint(0, 300),
        gap_fwd=rng.randint(50, 200),
        head_fwd_peak=rng.randint(150, 900),
        head_bwd_peak=rng.randint(150, 900),
        gap_bwd=rng.randint(150, 400),
        embed_bwd_peak=rng.randint(50, 400),
        opt_peak=rng.randint(0, 3000),
        micro_batch=4,
        seq_len=8,
        accum=accum,
        precision="bf16-mixed",
        device="cuda" if "offload" in treatments else "cpu",
        prefetch=rng.random() < 0.8,
        rest_ms=1.0,
        opt_ms=1.0,
    )


@pytest.mark.parametrize("seed", range(12))
def test_solver_is_exact_on_synthetic_profiles(seed: int) -> None:
    rng = random.Random(seed)
    treatments = ("none", "selective", "op_sac", "full", "offload") if seed % 2 else ("none", "op_sac", "full")
    prof = synthetic(rng, treatments, accum=1 + seed % 3 // 2, integer_ms=seed % 3 == 0)  # integer ms: ties
    assert assert_solver_exact(PeakModel(prof)) > 0


@pytest.mark.parametrize("seed", range(4))
def test_solver_is_exact_on_6_block_synthetic_profiles_where_pruning_is_busy(seed: int) -> None:
    rng = random.Random(100 + seed)
    treatments = ("none", "selective", "op_sac", "full") if seed % 2 else ("none", "op_sac", "full", "offload")
    prof = synthetic(rng, treatments, accum=1 + seed // 2, integer_ms=seed == 0, n_layer=6)
    assert assert_solver_exact(PeakModel(prof), max_budgets=40) > 0


def test_solver_takes_the_transient_where_it_happens() -> None:
    """A big recompute transient on the LAST block's backward coexists with every block's kept bytes; the same on
    block 0 coexists only with block 0's: the model tells them apart ('fixed + Σ kept + the largest
    transient' is the bound for the last block)."""
    rng = random.Random(0)
    prof = synthetic(rng, ("none", "full"), accum=2, integer_ms=False)
    prof.costs = [
        {
            "none": Cost(kept_fwd=100, kept=100, fwd_peak=100, transient=10, fwd_ms=1, bwd_ms=1),
            "full": Cost(kept_fwd=10, kept=10, fwd_peak=100, transient=200, fwd_ms=1, bwd_ms=2),
        }
        for _ in range(L)
    ]
    model = PeakModel(prof)
    first = model.evaluate(["full", "none", "none", "none"])
    last = model.evaluate(["none", "none", "none", "full"])
    assert first.peak < last.peak
    assert last.where == "backward, block 3"


def test_at_equal_time_the_solver_leaves_blocks_under_none() -> None:
    """Held at none's time, a treatment ties with none; of equally fast plans the solver takes the one with the most
    blocks under none, at every budget, also with 10 blocks, where the partial plans are pruned (>= 64 states)."""
    rng = random.Random(7)
    n = 10
    prof = synthetic(rng, ("none", "selective", "full"), accum=1, integer_ms=True, n_layer=n)
    prof.costs = [
        {
            "none": Cost(kept_fwd=100, kept=100, fwd_peak=120, transient=10, fwd_ms=1, bwd_ms=2),
            "selective": Cost(kept_fwd=60 + i, kept=60 + i, fwd_peak=120, transient=40, fwd_ms=1, bwd_ms=2),
            "full": Cost(kept_fwd=10, kept=10, fwd_peak=120, transient=110, fwd_ms=1, bwd_ms=3),
        }
        for i in range(n)
    ]
    model = PeakModel(prof)
    roomy = model.solve(10**9)
    assert roomy is not None and roomy.treatments == ("none",) * n
    for budget in sorted({model.evaluate(["none"] * k + ["selective"] * (n - k)).peak for k in range(n + 1)}):
        got = model.solve(budget)
        assert got is not None and got.peak <= budget
        fewest = min(
            sum(t != "none" for t in s.treatments)
            for k in range(n + 1)
            for s in [model.evaluate(["none"] * k + ["selective"] * (n - k))]
            if s.peak <= budget and s.step_ms == got.step_ms
        )
        assert sum(t != "none" for t in got.treatments) <= fewest, budget


def test_a_noisy_clock_cannot_make_recompute_look_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every treatment adds work to none's, so a clock that saw one faster saw noise: on real tensors each block's
    forward and backward time is held at least at none's (the profile says which were held), and a budget that fits
    none plans none everywhere whatever the clock said (a random clock, four seeds)."""
    held = 0
    for seed in range(4):
        rng = random.Random(seed)
        monkeypatch.setattr(profiler._Timer, "__call__", lambda self, fn, rng=rng: (fn(), rng.uniform(1.0, 2.0)))
        prof = timed_profile(repeats=3)
        for costs in prof.costs:
            none = costs["none"]
            assert all(c.fwd_ms >= none.fwd_ms and c.bwd_ms >= none.bwd_ms for c in costs.values())
        held += any(n.startswith("timed faster than none, held at none's time: ") for n in prof.notes)
        plan = PeakModel(prof).solve(1000 * MIB)
        assert plan is not None and plan.treatments == ("none",) * L, seed
    assert held  # the random clock did make some treatment look faster than none


# ----------------------------------------------------------------------------------------------------
# Real runs through trainer.core.run.train.
# ----------------------------------------------------------------------------------------------------

RUN = ["model.n_layer=3", "precision=32-true", "trainer.max_steps=6", "trainer.enable_checkpointing=false"]


def run_auto(compose_cfg: Any, tmp_path: Path, name: str, *overrides: str) -> tuple[dict[str, Any], dict[str, Any]]:
    cfg = compose_cfg("policy=auto", *RUN, *overrides)
    summary = train(cfg, tmp_path / name)
    auto = summary["auto"]  # the auto policy brings its planner (policy.callbacks())
    return summary, auto


@functools.cache
def uniform_peaks_mib(overrides: tuple[str, ...]) -> dict[str, float]:
    from hydra import compose, initialize_config_dir

    from tests.conftest import CONF, SMALL

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*SMALL, "policy=auto", "policy.budget_mib=1000", *RUN, *overrides])
    result = plan_result_for_config(validate(cfg))
    return {t: u.peak / MIB for t, u in result.uniform.items()}


def test_runs_stay_within_budget_at_several_budgets(
    compose_cfg: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Bytes are deterministic, times are not: with every timed run the same duration, ties go to the earlier
    # treatment (none first), so the roomy budget's plan does not depend on the machine's load.
    monkeypatch.setattr(profiler._Timer, "__call__", lambda self, fn: (fn(), 1.0))
    peaks = uniform_peaks_mib(())
    assert peaks["none"] > peaks["selective"] > peaks["op_sac"] > peaks["full"]
    budgets = {
        "roomy": peaks["none"] + 0.01,  # store everything
        "middle": (peaks["selective"] + peaks["op_sac"]) / 2,
        "tight": peaks["full"] + 0.002,  # only (nearly) full recompute fits
    }
    plans = {}
    for name, budget in budgets.items():
        summary, auto = run_auto(compose_cfg, tmp_path, name, f"policy.budget_mib={budget}")
        assert summary["status"] == "completed" and summary["policy"] == "auto"
        assert summary["peak_total_mib"] is not None
        assert summary["peak_total_mib"] <= budget, (name, summary["peak_total_mib"], budget)
        assert auto["predicted_peak_mib"] <= budget and auto["fits"] and not auto["replanned"]
        assert auto["measured_peak_mib"] == pytest.approx(summary["peak_total_mib"])
        # the model errs high by Lightning's bookkeeping scalars at most
        assert 0 <= auto["predicted_peak_mib"] - auto["measured_peak_mib"] <= BOOKKEEPING / MIB
        assert summary["plan"] == auto["plan_describe"]
        # every registered treatment was a candidate (offload runs as none on CPU, so it is left out here)
        assert set(auto["runner_up"]) == set(treatments()) - {"offload"}
        assert {"none", "selective", "op_sac", "full", "torchtitan_sac"} <= set(auto["runner_up"])
        assert len(auto["blocks"]) == 3 and auto["budget_mib"] == pytest.approx(budget, abs=1e-4)
        plans[name] = auto["plan"]
    assert plans["roomy"] == ["none"] * 3
    assert len({tuple(p) for p in plans.values()}) == 3, plans  # three budgets, three plans (a != b != c skips a, c)


def test_a_prediction_too_low_is_caught_and_re_planned_once(
    compose_cfg: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    peaks = uniform_peaks_mib(())
    budget = (peaks["selective"] + peaks["op_sac"]) / 2
    # Equal times (ties go to the earlier treatment): the plan is the one closest under the budget whatever the
    # machine's load, so the under-prediction below puts it over.
    monkeypatch.setattr(profiler._Timer, "__call__", lambda self, fn: (fn(), 1.0))
    # Make the model under-predict every phase by 0.15 MiB: the first plan will not fit when measured.
    monkeypatch.setattr(planner.peak, "BOOKKEEPING", BOOKKEEPING - int(0.15 * MIB))
    summary, auto = run_auto(compose_cfg, tmp_path, "replan", f"policy.budget_mib={budget}")
    assert auto["replanned"] is True
    assert auto["measured_before_replan_mib"] > budget
    assert auto["first_plan"]["plan"] != auto["plan"]
    assert auto["measured_peak_mib"] <= budget
    assert summary["plan"] == auto["plan_describe"]


def test_estimate_and_train_agree_on_the_plan(
    compose_cfg: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    budget = (lambda p: (p["selective"] + p["op_sac"]) / 2)(uniform_peaks_mib(()))
    # Bytes are deterministic; times are not. Give every timed run the same duration so that both paths see the
    # same costs (ties then go to the earlier treatment), and compare the plans the one function produces.
    monkeypatch.setattr(profiler._Timer, "__call__", lambda self, fn: (fn(), 1.0))
    config = validate(compose_cfg("policy=auto", *RUN, f"policy.budget_mib={budget}"))
    plan, loss, text = plan_for_config(config)
    estimated = plan_result_for_config(config)
    assert loss == "standard"
    summary, auto = run_auto(compose_cfg, tmp_path, "agree", f"policy.budget_mib={budget}")
    assert plan.describe() == auto["plan_describe"] == summary["plan"]
    assert estimated.solution.peak / MIB == pytest.approx(auto["predicted_peak_mib"], abs=1e-9)
    assert {k: v["predicted_peak_mib"] for k, v in auto["runner_up"].items()} == pytest.approx(
        {k: u.peak / MIB for k, u in estimated.uniform.items()}
    )
    assert text.startswith("policy=auto: budget") and plan.describe() in text and "| block |" in text


def test_refusal_is_one_line_with_a_budget_and_a_micro_batch_that_fit(compose_cfg: Any, tmp_path: Path) -> None:
    peaks = uniform_peaks_mib(())
    budget = peaks["full"] - 0.05
    config = validate(compose_cfg("policy=auto", *RUN, f"policy.budget_mib={budget}"))
    with pytest.raises(PolicyError) as e:
        plan_for_config(config)
    line = str(e.value)
    assert "\n" not in line and line.startswith("policy auto: no plan fits policy.budget_mib=")
    need = float(line.split("give policy.budget_mib=")[1].split()[0])
    micro = int(line.split("batch_size=")[1].split()[0])
    assert need >= peaks["full"] - 1e-3 and 1 <= micro < config.batch_size
    # both suggestions hold
    ok = validate(compose_cfg("policy=auto", *RUN, f"policy.budget_mib={need}"))
    assert plan_result_for_config(ok).solution.peak <= need * MIB
    smaller = validate(compose_cfg("policy=auto", *RUN, f"policy.budget_mib={budget}", f"batch_size={micro}"))
    assert plan_result_for_config(smaller).solution.peak <= budget * MIB
    # a run refuses the same way, before training
    cfg = compose_cfg("policy=auto", *RUN, f"policy.budget_mib={budget}")
    with pytest.raises(PolicyError) as e2:
        train(cfg, tmp_path / "refused")
    assert str(e2.value) == line
    assert not (tmp_path / "refused").exists()  # its TensorBoard event file, opened before fit, went with it


def test_allow_accum_halves_the_micro_batch_when_nothing_fits(compose_cfg: Any, tmp_path: Path) -> None:
    peaks = uniform_peaks_mib(())
    budget = peaks["full"] - 0.05
    summary, auto = run_auto(compose_cfg, tmp_path, "accum", f"policy.budget_mib={budget}", "policy.allow_accum=true")
    assert (auto["micro_batch"], auto["accum"]) == (2, 2)
    assert summary["peak_total_mib"] <= budget
    assert summary["tokens_per_step"] == 4 * 32  # the configured tokens per step, trained as 2 × 2 × 32


@pytest.mark.parametrize(
    "cfg, words",
    [
        ({"name": "auto"}, ["needs a budget", "policy.budget_mib"]),
        ({"name": "auto", "budget_mib": 10, "budget_gb": 1}, ["exactly one", "budget_mib", "budget_gb"]),
        ({"name": "auto", "budget_mib": -1}, ["policy.budget_mib=-1", "> 0"]),
        ({"name": "auto", "budget_fraction": 1.5}, ["budget_fraction=1.5", "(0, 1]"]),
        ({"name": "auto", "budget_mib": 10, "candidates": ["fulll"]}, ["unknown treatment 'fulll'", "candidates"]),
        ({"name": "auto", "budget_mib": 10, "profile_repeats": 0}, ["profile_repeats=0"]),
        ({"name": "auto", "budget_mib": 10, "loss_candidates": ["chunkd"]}, ["unknown loss head 'chunkd'", "fused"]),
    ],
)
def test_bad_auto_config_is_one_clear_line(cfg: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(PolicyError) as e:
        apply_policy(copy.deepcopy(base_model()), cfg)
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fraction is refused only without a CUDA device")
def test_budget_fraction_without_cuda_is_refused() -> None:
    with pytest.raises(PolicyError, match="budget_fraction=0.5 is a fraction of a CUDA device"):
        apply_policy(copy.deepcopy(base_model()), {"name": "auto", "budget_fraction": 0.5})


def test_auto_is_registered_and_checkpoints_everything_until_planned() -> None:
    assert "auto" in POLICIES
    model = copy.deepcopy(base_model())
    policy = apply_policy(model, {"name": "auto", "budget_mib": 10})
    assert model.activation_plan.describe() == "[0-3]:full"
    policy.choose(["none", "selective", "full", "op_sac"])
    apply_policy(model, policy)
    assert model.activation_plan.describe() == "[0]:none [1]:selective [2]:full [3]:op_sac"


# ----------------------------------------------------------------------------------------------------
# Gradient equivalence: auto at several budgets == none, bit for bit.
# ----------------------------------------------------------------------------------------------------


def train_step(model: Any, accum: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    idx, tgt = batches()
    model.train()
    model.zero_grad(set_to_none=True)
    losses = []
    for i in range(accum):
        torch.manual_seed(1000 + i)  # the same dropout masks for every policy
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx[i], tgt[i])[1]
        (loss / accum).backward()
        losses.append(loss.detach())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]


@pytest.mark.parametrize("accum", [1, 2])
def test_auto_at_several_budgets_gives_the_gradients_of_none_bitwise(accum: int) -> None:
    ref_losses, ref_grads = train_step(copy.deepcopy(base_model()), accum)
    model = PeakModel(profiled(accum))
    uniform = {t: model.evaluate([t] * L).peak for t in model.prof.treatments}
    budgets = [uniform["none"], (uniform["none"] + uniform["selective"]) // 2, uniform["op_sac"], uniform["full"]]
    seen = set()
    for budget in budgets:
        gpt = copy.deepcopy(base_model())
        idx, tgt = batches()
        weights = {k: v.clone() for k, v in gpt.state_dict().items()}
        rng = torch.get_rng_state()
        result = planner.plan_model(
            gpt,
            (idx[0], tgt[0]),
            auto_cfg(budget_mib=budget / MIB, profile_repeats=1),
            loss_fns={"standard": loss_fn(gpt)},
            precision="bf16-mixed",
            accum=accum,
            make_optimizer=planner.default_optimizer(),
            param_groups=param_groups(gpt, 0.1),
            grad_clip=1.0,
        )
        # planning changed neither the weights nor the RNG, and left no gradients behind
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(torch.equal(v, weights[k]) for k, v in gpt.state_dict().items())
        assert all(p.grad is None for p in gpt.parameters())
        policy = apply_policy(gpt, {"name": "auto", "budget_mib": budget / MIB})
        policy.choose(result.treatments)
        apply_policy(gpt, policy)
        seen.add(gpt.activation_plan.describe())
        losses, grads = train_step(gpt, accum)
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
        differ = [n for n in grads if not torch.equal(grads[n], ref_grads[n])]
        assert not differ, (result.plan.describe(), differ)
    assert len(seen) >= 3, seen


def test_the_profile_counts_a_sharded_parameter_by_its_local_shard() -> None:
    """FSDP2's and tensor parallelism's parameters are DTensors, whose own storage reports the global size: the
    planner's state bytes are each rank's shard (counted globally, the most frugal plan of llama-tiny on FSDP2 2 read
    72.1 MiB where the run peaks at 38.1 MiB; 39.4 MiB with the shard)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainer.measure.fake.process_group import fake_mesh, release
    from trainer.planner.profiler import _unique_bytes

    mesh, group = fake_mesh(4, "cpu")
    try:
        weight = distribute_tensor(torch.zeros(64, 32), mesh, [Shard(0)])
        assert weight.untyped_storage().nbytes() == 64 * 32 * 4  # the global size, as torch reports it
        assert _unique_bytes([weight, weight, None]) == 16 * 32 * 4  # one rank's shard, once
    finally:
        release(group)
