"""The benchmarks' plumbing on tiny shapes (model=micro, seq 32): every figure from the one step and the one
estimator, every registered policy and loss head a row, the header naming where it ran, the docs block writer (each
table on its docs page, between its markers), the paragraphs on how close the step-time sources came, and the
estimator's step-time table. Timings are never asserted; bytes and FLOPs are exact and are."""

from __future__ import annotations

import contextlib
import csv
import datetime as dt
import io
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import planner as bench_planner
from bench import policies as bench
from bench import step_time_table
from bench.accuracy import Point, rankings_text, sources_text
from bench.common import BENCHMARKS_PAGE, STEP_TIME_PAGE, cpu_name, replace_block
from bench.policies_report import ACCURACY, POLICY_TABLE, TABLE
from tests.conftest import ROOT
from trainer.policies import POLICIES, Plan
from trainer.precision import cpu_bf16_native, resolve

MIB = 2**20
# the roofline's calibration read from the suite's cache: measuring it beside every run doubled these tests' time
MICRO = ["--model", "micro", "--seq", "32", "--cached-speed"]
HEAD_VOCAB = 4096


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of every policy and every loss head (under none and full) at the micro shape, written to a copy of
    the benchmarks page (docs/benchmarks.md, where its table lives)."""
    tmp = tmp_path_factory.mktemp("bench")
    page = tmp / "benchmarks.md"
    page.write_text(BENCHMARKS_PAGE.read_text())
    args = [*MICRO, "--rounds", "2", "--overhead-steps", "2", "--head-vocab", str(HEAD_VOCAB)]
    args += ["--out", str(tmp / "out"), "--write-docs", "--page", str(page)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = bench.main(args)
    assert rc == 0
    data = json.loads((tmp / "out" / "results.json").read_text())
    return {"out": tmp / "out", "page": page, "printed": stdout.getvalue(), "data": data}


# auto plans at fit start (bench.planner plans it); memory_budget is decided as the model compiles (bench.compiled)
EAGER_ROWS = [n for n in POLICIES if n != "auto" and not POLICIES[n].caps.requires_compile]


def _rows(data: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in data["rows"] if r["kind"] == kind}


def test_every_registered_policy_is_a_row_measured_as_the_estimator_predicts(micro_run: dict[str, Any]) -> None:
    data = micro_run["data"]
    rows = _rows(data, "policy")
    samples = data["samples"]["micro model=micro seq_len=32"]["step_s"]
    assert list(rows) == EAGER_ROWS  # the registry's order, every policy an eager step runs
    assert list(data["sections"][0]["skipped"]) == ["memory_budget", "auto"]
    assert "trainer.compile=true" in data["sections"][0]["skipped"]["memory_budget"]
    assert "needs a budget" in data["sections"][0]["skipped"]["auto"]
    for name, r in rows.items():
        # the estimator on fake tensors and StepMeter over the real step: the same figures
        assert r["activation_mib"] == pytest.approx(r["est_activation_mib"], rel=0.005), name
        assert r["peak_total_mib"] == pytest.approx(r["est_peak_total_mib"], rel=0.005), name
        assert r["head_mib"] == pytest.approx(r["est_head_mib"], rel=0.005), name
        assert r["flops_ratio"] == pytest.approx(r["est_flops_ratio"], rel=1e-9), name
        assert r["est_error"] is None and r["flops_uncounted"] == ""
        assert r["peak_total_mib"] > r["activation_mib"]  # weights, gradients and AdamW state on top
        assert len(samples[f"{name}|standard"]) == 2  # one step per round
    none, full, sel = rows["none"], rows["full"], rows["selective"]
    assert none["step_ratio"] == 1.0 and none["flops_ratio"] == 1.0 and none["activation_ratio"] == 1.0
    assert full["plan"] == "[0-1]:full" and rows["per_block"]["plan"] == "[0]:full [1]:none"
    # full recomputes the layers' whole forward; at micro the head is a large part of the step
    # under bf16 autocast the layer inputs full keeps stay fp32 (the residual stream) while much of what none keeps
    # is bf16, so full keeps a larger share of none's bytes (0.52 at this shape) than in fp32
    kept = 0.5 if data["sections"][0]["precision"] == "32-true" else 0.55
    assert 1.2 < full["flops_ratio"] < 1.4 and full["activation_ratio"] < kept
    assert 1.0 < sel["flops_ratio"] < full["flops_ratio"] and sel["activation_ratio"] < 1.0
    assert rows["offload"]["activation_mib"] == none["activation_mib"]  # no CUDA: a no-op move


def test_loss_heads_are_rows_with_the_heads_share(micro_run: dict[str, Any]) -> None:
    heads = _rows(micro_run["data"], "head")
    assert list(heads) == [f"{p}/{h}" for p in ("none", "full") for h in ("standard", "chunked", "fused")]
    assert {r["vocab"] for r in heads.values()} == {HEAD_VOCAB}
    for policy in ("none", "full"):
        std, chunked, fused = (heads[f"{policy}/{h}"] for h in ("standard", "chunked", "fused"))
        assert std["step_ratio"] == 1.0 and std["flops_ratio"] == 1.0
        assert std["head_share"] > 0.8  # at a 4K vocabulary the logits are most of the activation peak
        assert chunked["head_mib"] < std["head_mib"] / 2 and fused["head_mib"] < chunked["head_mib"]
        assert chunked["head_share"] < std["head_share"] and fused["head_share"] < std["head_share"]
        assert chunked["activation_mib"] < std["activation_mib"] and chunked["peak_total_mib"] < std["peak_total_mib"]
        assert chunked["flops_ratio"] > 1.2  # its logits are recomputed in backward
        for r in (std, chunked, fused):
            assert r["head_mib"] == pytest.approx(r["est_head_mib"], rel=0.005)
            assert r["activation_mib"] == pytest.approx(r["est_activation_mib"], rel=0.005)
        assert chunked["label"] == "chunked (chunk_tokens=32)"  # tokens / 4 of the 4 × 32 micro-batch
    # the policy rows' `none` at the byte vocabulary is another configuration: another module, other bytes
    assert heads["none/standard"]["activation_mib"] > 2 * _rows(micro_run["data"], "policy")["none"]["activation_mib"]


def _outside(text: str, *markers: tuple[str, str]) -> str:
    """The page with each marked block's content left out: what a block writer must leave as it was."""
    for start, end in markers:
        pre, rest = text.split(start, 1)
        text = pre + start + end + rest.split(end, 1)[1]
    return text


def test_outputs_header_and_docs_blocks(micro_run: dict[str, Any]) -> None:
    out, data, printed = micro_run["out"], micro_run["data"], micro_run["printed"]
    with (out / "results.csv").open() as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["name"] for r in csv_rows] == [r["name"] for r in data["rows"]]
    overhead = [r for r in data["rows"] if r["kind"] == "overhead"]
    assert len(overhead) == 1 and overhead[0]["pairs"] == 2  # the head rows' section has no Lightning comparison
    table = (out / "table.md").read_text().strip()
    assert table in printed
    head = table.splitlines()[0]
    native, _ = cpu_bf16_native()
    used, _ = resolve("auto", "cpu")
    for text in (cpu_name(), f"torch {torch.__version__}", "1 thread,", dt.date.today().isoformat(), f"→ {used}"):
        assert text in head
    assert ("(native bf16)" in head) is native
    assert "Not run: `auto`" in head
    uniform = [f"{t}:" for t in ("none", "selective", "op_sac", "full") for _ in ("profile", "roofline")]
    assert [t["target"].split()[0] for t in data["targets"]] == [
        "full",
        "selective",
        "Lightning",
        "activation",
        *uniform,
        "full:",
    ]
    # both step-time sources predicted every uniform policy; composite plans (groups) have the roofline only
    rows = {r["name"]: r for r in data["rows"] if r["kind"] == "policy"}
    for t in ("none", "selective", "op_sac", "full"):
        assert rows[t]["pred_profile_ms"] > 0 and rows[t]["pred_roofline_ms"] > 0
    assert rows["every_k"]["pred_profile_ms"] is None and rows["every_k"]["pred_roofline_ms"] > 0
    assert "| predicted: profile | ÷ measured | predicted: roofline |" in table
    # --write-docs on a copy of the page: each block between its markers is the printed one, the rest as it was
    accuracy = (out / "accuracy.md").read_text().strip()
    assert accuracy in printed and accuracy.startswith("From `python -m bench.policies --model micro")
    # how each source ranks the uniform policies is said once, in the paragraph, not again under the table
    assert "The profile " in accuracy and "the roofline " in accuracy and "Ranking" not in table
    before, after = BENCHMARKS_PAGE.read_text(), micro_run["page"].read_text()
    assert f"{TABLE.start}\n{table}\n{TABLE.end}" in after
    assert f"{ACCURACY.start}\n{accuracy}\n{ACCURACY.end}" in after
    assert after.split(POLICY_TABLE.start)[0] == before.split(POLICY_TABLE.start)[0]
    blocks = ((TABLE.start, TABLE.end), (ACCURACY.start, ACCURACY.end), (POLICY_TABLE.start, POLICY_TABLE.end))
    assert _outside(after, *blocks) == _outside(before, *blocks)
    for start, end in blocks:
        assert after.count(start) == after.count(end) == 1


def test_several_models_in_one_run(tmp_path: Path) -> None:
    args = ["--models", "micro,llama-tiny", "model.n_layer=2", "model.n_embd=64", "--seq", "32", "--cached-speed"]
    args += ["--policies", "full"]
    args += ["--rounds", "1", "--overhead-steps", "0", "--head-vocab", "0", "--out", str(tmp_path)]
    with contextlib.redirect_stdout(io.StringIO()):
        assert bench.main(args) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    rows = [(r["model"], r["name"]) for r in data["rows"]]
    assert rows == [("micro", "none"), ("micro", "full"), ("llama-tiny", "none"), ("llama-tiny", "full")]
    assert [s["shape"].split()[1] for s in data["sections"]] == ["(gpt:", "(llama:"]
    for r in data["rows"]:
        assert r["activation_mib"] == pytest.approx(r["est_activation_mib"], rel=0.005)
    table = (tmp_path / "table.md").read_text()
    assert "| llama-tiny | `full` |" in table and "| micro | `full` |" in table


def test_the_policy_table_is_the_benchmarks_own_rows(micro_run: dict[str, Any]) -> None:
    """The policy-table block (every policy against none) is written by bench.policies from the rows it measured:
    the same plans, bytes and FLOPs, in the registry's order, once each."""
    rows = _rows(micro_run["data"], "policy")
    block = micro_run["page"].read_text().split(POLICY_TABLE.start)[1].split(POLICY_TABLE.end)[0]
    lines = [line for line in block.splitlines() if line.startswith("| `")]
    assert len(lines) == len(rows) == len(EAGER_ROWS)
    for line, r in zip(lines, rows.values(), strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0].startswith(f"`{r['policy']}`") and cells[1] == f"`{r['plan']}`", line
        assert cells[2] == f"{r['activation_mib']:.1f}" and cells[4] == f"{r['flops'] / 1e9:.2f}", line
        assert cells[3] == f"{r['activation_mib'] / rows['none']['activation_mib']:.2f}", line
    assert cpu_name() in block and "| `full` | `[0-1]:full` |" in block
    assert "| `per_block` (pattern=[full, none]) | `[0]:full [1]:none` |" in block  # its parameters by its name


def test_planner_bench_plans_fit_their_budgets() -> None:
    out = bench_planner.run(["model=micro", "seq_len=32", "precision=32-true"], n_budgets=6, reps=1, recalibrate=False)
    rows = out["rows"]
    assert len(rows) == 6 and all("result" in r for r in rows)
    from trainer.policies import treatments

    # every uniform treatment the registry has, in its order (offload: no CUDA here)
    assert list(out["predicted"]) == [t for t in treatments() if t != "offload"]
    assert {"none", "selective", "op_sac", "torchtitan_sac", "full"} <= set(out["predicted"])
    for t, p in out["predicted"].items():  # the peak model against StepMeter's whole-step figure
        assert abs(p.peak - out["uniform"][t]["peak"]) <= 32 * 1024, t
    for r in rows:
        assert r["measured"]["peak"] <= r["budget_mib"] * MIB  # the planner's promise, measured
        assert r["measured"]["installed"] == Plan.per_block(r["result"].treatments)  # installed as planned
    last = rows[-1]  # below every uniform plan: refused at micro-batch 4, allow_accum trains smaller micro-batches
    assert "refused_below_mib" in last and last["result"].micro_batch < 4 and last["uniform"] is None
    text = bench_planner.header(out) + "\n\n" + bench_planner.tables(out)
    assert cpu_name() in text and "with `allow_accum=true`: micro-batch" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_device_fails_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--device", "cuda", "--model", "gpt2"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("error: --device cuda: no CUDA device"), err


def test_a_policy_the_model_refuses_fails_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([*MICRO, "model.n_layer=1", "--policies", "every_k", "--head-vocab", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --policies every_k: policy every_k: policy.k=2 must be between 1 and")


def test_docs_writer_replaces_only_the_marked_block(tmp_path: Path) -> None:
    start, end = TABLE.start, TABLE.end
    page = tmp_path / "benchmarks.md"
    before = "# title\n\n<!-- policy-table:start -->\nother block\n<!-- policy-table:end -->\n\n## Bench\n\n"
    after = "\n\ntrailing text\n"
    page.write_text(f"{before}{start}\nold table\n{end}{after}")
    replace_block(page, start, end, "new table\nline 2", TABLE.heading)
    assert page.read_text() == f"{before}{start}\nnew table\nline 2\n{end}{after}"
    replace_block(page, start, end, "newer", TABLE.heading)  # again: still one block, the rest untouched
    assert page.read_text() == f"{before}{start}\nnewer\n{end}{after}"
    fresh = tmp_path / "FRESH.md"  # no markers yet: a section holding them is appended
    fresh.write_text("# title\n\nbody\n")
    replace_block(fresh, start, end, "table", TABLE.heading)
    assert fresh.read_text() == f"# title\n\nbody\n\n{TABLE.heading}\n\n{start}\ntable\n{end}\n"


def test_command_line_to_rerun_drops_the_output_flags() -> None:
    args = ["--model", "gpt2", "--out", "/tmp/x", "--device", "cuda", "--write-readme", "--out=/y", "--readme", "R"]
    assert bench.command_line(args) == "python -m bench.policies --model gpt2 --device cuda"
    args = ["--model", "gpt2", "--write-docs", "--page", "P", "--device", "cuda", "--page=Q"]
    assert bench.command_line(args) == "python -m bench.policies --model gpt2 --device cuda"


def test_a_short_context_caps_the_default_seq_len_before_the_config_is_composed() -> None:
    """bench.policies without seq_len: the conf default (256) capped at the model's context, read before composing
    (the composed config would refuse 256 on micro's 64): its docstring's smoke command runs."""
    from bench.policies import model_overrides, parse_args

    assert model_overrides(parse_args(["--model", "micro"]), "micro") == ["model=micro", "seq_len=64"]
    args = parse_args(["--model", "micro", "model.block_size=32"])
    assert model_overrides(args, "micro") == ["model=micro", "model.block_size=32", "seq_len=32"]
    assert model_overrides(parse_args(["--model", "tiny"]), "tiny") == ["model=tiny"]


def test_the_benchmark_tables_live_on_their_docs_pages() -> None:
    """Every block a benchmark writes sits on its docs page, between its markers, once."""
    pages = {
        BENCHMARKS_PAGE: [POLICY_TABLE, TABLE, ACCURACY, bench_planner.TABLE, bench_planner.ACCURACY],
        STEP_TIME_PAGE: [step_time_table.TABLE, step_time_table.CONSTANTS],
    }
    for page, markers in pages.items():
        text = page.read_text()
        for block in markers:
            start, end = block.start, block.end
            assert text.count(start) == text.count(end) == 1 and text.index(start) < text.index(end), (page, start)


def _point(model: str, policy: str, ms: float, profile: float, roofline: float, spread: float = 0.05) -> Point:
    return Point(model, policy, ms, spread, profile, roofline)


def test_how_close_names_the_range_the_misses_and_the_swaps() -> None:
    points = [
        _point("tiny", "none", 100, 102, 90),
        _point("tiny", "full", 130, 127, 117),
        _point("llama", "none", 100, 101, 88),
        _point("llama", "op_sac", 120, 118, 98, spread=0.07),  # the roofline 18.3 % low: beyond its 15 %
        _point("llama", "full", 110, 111, 100, spread=0.12),
    ]
    text = sources_text(points, {"profile": 0.05, "roofline": 0.15})
    assert text == (
        "the profile's prediction lies within 0.9–2.3 % of the measured step for every uniform policy on `tiny` and "
        "`llama`, low in 2 of 5 rows; the roofline within 9.1–12.0 % (except `op_sac` on `llama`, 18.3 % low), "
        "low in every row"
    )
    assert "except" not in sources_text(points)  # without targets, every row is in the range
    assert rankings_text(points) == (
        "The profile ranks the uniform policies as measured on `tiny` and `llama`; the roofline ranks them as "
        "measured on `tiny` and swaps `op_sac` and `full` on `llama`, whose measured times lie within their noise "
        "(120 ms ±7 % vs 110 ms ±12 %)"
    )
    far = [_point("m", "none", 100, 100, 90, spread=0.01), _point("m", "full", 130, 131, 80, spread=0.01)]
    assert rankings_text(far).endswith("whose measured times lie outside their noise (130 ms ±1 % vs 100 ms ±1 %)")


def test_planner_accuracy_says_where_auto_lost_to_a_uniform_plan() -> None:
    from types import SimpleNamespace

    uniform = {"none": {"ms": 395.0, "spread": 0.04}, "selective": {"ms": 424.0, "spread": 0.05}}
    rows = [
        {"budget_mib": 260.2, "uniform": "none", "measured": {"ms": 395.0, "spread": 0.04}},
        {"budget_mib": 207.1, "uniform": "selective", "measured": {"ms": 432.0, "spread": 0.04}},
        {"budget_mib": 100.9, "uniform": None, "measured": {"ms": 506.0, "spread": 0.03}},  # none fits: no comparison
    ]
    env = {"date": "d", "torch": "t", "device": "cpu", "cpu": "c", "cpu_bf16_native": False, "threads": 1}
    env |= {"precision_requested": "32-true", "precision": "32-true"}
    out = {
        "config": SimpleNamespace(model=SimpleNamespace(name="tiny")),
        "predicted": dict.fromkeys(uniform),
        "uniform": uniform,
        "profile_ms": {"none": 386.0, "selective": 439.0},
        "roofline": {"none": 352.0, "selective": 414.0},
        "rows": rows,
        "env": env,
    }
    text = bench_planner.accuracy([out], "python -m bench.planner --write-docs")
    assert text.startswith("From `python -m bench.planner --write-docs` (d, torch t, CPU c (no native bf16")
    assert "within 2.3–3.5 %" in text and "the roofline within 2.4–10.9 %, low in every row" in text
    assert text.endswith(
        "`policy=auto` took a plan at most as slow as the fastest uniform plan that fits at every budget but one "
        "(`tiny` at 207.1 MiB: 1.02×, inside that row's ±4–5 % noise)."
    )


def test_step_time_table_is_the_estimators_figures(tmp_path: Path) -> None:
    """bench.step_time_table prints what `python -m trainer.estimate … --gpu` predicts, per policy and GPU, and
    --write-docs puts it between its markers of a copy of docs/step-time.md, the rest as it was."""
    from trainer.estimate import main as estimate_main

    overrides = ["model=micro", "seq_len=32"]
    out = step_time_table.run(overrides, ["H100-80GB", "L4-24GB"], workers=1)
    assert "auto" in out["left_out"] and "auto" not in out["estimates"] and "memory_budget" in out["left_out"]
    assert list(out["estimates"]) == EAGER_ROWS
    for gpu in ("H100-80GB", "L4-24GB"):
        path = tmp_path / f"{gpu}.json"
        with contextlib.redirect_stdout(io.StringIO()):
            assert estimate_main([*overrides, "--gpu", gpu, "--json", str(path)]) == 0
        doc = json.loads(path.read_text())["all_policies"]
        for name, e in out["estimates"].items():
            assert out["times"][(name, gpu)].ms == pytest.approx(doc[name]["predicted_step"]["ms"], rel=1e-9)
            assert e.flops == doc[name]["flops"] and e.plan == doc[name]["plan"]
    page = tmp_path / "step-time.md"
    page.write_text(STEP_TIME_PAGE.read_text())
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert step_time_table.main([*overrides, "--workers", "1", "--write-docs", "--page", str(page)]) == 0
    block = stdout.getvalue().strip()
    assert block.startswith("Generated by `python -m bench.step_time_table model=micro seq_len=32 --write-docs`")
    assert "| policy | plan | FLOPs × none | H100-80GB step ms | tokens/s | L4-24GB step ms | tokens/s |" in block
    assert "Not in the table: `auto`" in block
    before, after = STEP_TIME_PAGE.read_text(), page.read_text()
    start, end = step_time_table.TABLE.start, step_time_table.TABLE.end
    assert f"{start}\n{block}\n{end}" in after
    assert _outside(after, (start, end)) == _outside(before, (start, end))


def test_gpu_script_parses() -> None:
    proc = subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_fit_time_prints_both_times_and_their_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import fit_time

    assert fit_time.main(["model=micro", "seq_len=32"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("model=micro seq_len=32, --device cuda, precision ")
    assert "estimate alone " in out[1] and "× (" in out[1] and "world sizes estimated: 1" in out[1]


@pytest.mark.slow
def test_the_published_fsdp_row_reserves_what_torchtitan_published() -> None:
    """torchtitan's Table 1 "FSDP" row in our words (FSDP2's bf16 policy, its per-op policy, 8 ranks): the step's
    tensors replayed through CUDA's caching allocator reserve between 85 % and 100 % of the published 82.4 GiB
    (the rest: what one stream cannot show); the tensors alone stay below it; collectives are costed."""
    from bench import published

    row = published.torchtitan_fsdp_row()
    published_bytes = published.TORCHTITAN_TABLE[0][2] * 2**30
    assert 0.85 * published_bytes <= row.reserved_bytes <= published_bytes, row
    assert row.allocated_bytes < row.reserved_bytes
    assert row.exposed_collective_ms > 0


@pytest.mark.slow
def test_the_compiled_benchmark_measures_each_variant_its_own_way() -> None:
    """bench.compiled on micro: eager and compiled `none` side by side (their activation peaks differ: the compiled
    one is the allocator's count of what inductor's code keeps), and memory_budget at 1 and 0 (0 recomputes what 1
    saves), every row timed; the estimator's figures beside each (its compiled peaks are the measured ones); the
    table and the README's summary render with a ratio per figure. `auto` under compile at two levels: each plan a
    row of its own (a uniform `none` plan would be that row, not measured again), whose measured peak is the plan's
    predicted one (the model compiled whole) and within its level."""
    from bench import compiled
    from trainer.planner import PlanResult

    out = compiled.run("micro", ["seq_len=32", "batch_size=2"], reps=2, budgets=[1.0, 0.0], policies=["none"], levels=2)
    rows = {r.label: r for r in out["rows"]}
    plans = [out["plans"][level] for level in out["levels"]]
    assert all(isinstance(p, PlanResult) for p in plans)
    for level, plan in zip(out["levels"], plans, strict=True):
        label = "none compiled" if set(plan.treatments) == {"none"} else f"auto {plan.plan.describe()}"
        assert rows[label].total == plan.solution.peak <= level * MIB, label
    for plan in plans:
        rows.pop(f"auto {plan.plan.describe()}", None)
    assert list(rows) == ["none eager", "none compiled", "memory_budget 1", "memory_budget 0"]
    assert rows["none compiled"].activation != rows["none eager"].activation
    assert rows["memory_budget 0"].activation < rows["memory_budget 1"].activation
    assert all(len(r.times) == 2 and r.est_ms > 0 for r in rows.values())
    assert all(r.est_total == r.total for r in rows.values() if r.compiled)
    text = compiled.table(out)
    assert "| `none` |" in text and "| 0 |" in text and "fastest first: predicted" in text
    assert all(f"| `{p.plan.describe()}` |" in text for p in plans) and "`auto` (compiled)" in text
    assert "| `micro` | `none` |" in compiled.summary([out], "python -m bench.compiled")


# ---- bench.calibrate: a device's measured figures, preferred by the estimator ------------------------------------

CPU_ENTRY = "name: this-cpu\nmemory: 8GiB\nbandwidth: 0.05TB/s\ntflops: {fp32: 1.0, bf16: 1.0}\n"
CALIBRATE_SHAPES = ["model=micro", "seq_len=32", "batch_size=2", "precision=32-true"]


def test_calibrate_measures_this_cpu_and_the_time_model_prefers_it(tmp_path: Path) -> None:
    """The GPU calibration's code run on this CPU (as bench/gpu.sh runs it on a GPU): the model's GEMMs, attention
    forward and backward, a copy and a small op are measured at the model's shapes and written as the entry's
    `measured:` block (a second run replaces it); a speed for that entry then takes those rates, and says so."""
    from bench import calibrate
    from trainer.measure.gpus import load_catalogue
    from trainer.measure.time.roofline import gpu_speed

    entry = tmp_path / "this-cpu.yaml"
    entry.write_text("# a CPU as a catalogue entry\n" + CPU_ENTRY)
    for _ in range(2):
        assert calibrate.main(["--device", "cpu", "--write", str(entry), "--reps", "2", *CALIBRATE_SHAPES]) == 0
    text = entry.read_text()
    assert text.startswith("# a CPU as a catalogue entry\n") and text.count("measured:") == 1
    gpu = load_catalogue([entry])["this-cpu"]
    assert gpu.measured is not None and set(gpu.measured.matmul) == {"fp32"}
    m = gpu.measured
    assert m.matmul["fp32"] > 0 and m.attention["fp32"] > 0 and m.bandwidth > 0 and 0 < (m.launch_s or 0) < 1
    speed = gpu_speed(gpu)
    assert speed.matmul["fp32"][0][1] == pytest.approx(m.matmul["fp32"], rel=1e-5)
    assert speed.attention is not None and speed.attention["fp32"][0][1] == pytest.approx(m.attention["fp32"], rel=1e-5)
    assert speed.bandwidth["memory"][0][1] == pytest.approx(m.bandwidth, rel=1e-5) and speed.op_s == m.launch_s
    slow, fast = speed.ends or (None, None)
    assert slow is not None and fast is not None  # the measured dtype is a point at both ends, not a range
    assert slow.matmul["fp32"] == fast.matmul["fp32"] == speed.matmul["fp32"]
    assert slow.matmul["bf16"] != fast.matmul["bf16"]  # bf16 was not measured: its published range stays
    assert "measured on CPU" in speed.describe() and "bench.calibrate" in speed.describe()


def test_calibrate_refuses_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import calibrate

    for args, says in (
        (["--device", "cpu", "--write", str(tmp_path / "none.yaml")], "not a catalogue entry"),
        (["--device", "cpu", "--write-matched", str(tmp_path / "catalogue")], "run it on one"),
        (["--device", "cpu", "--reps", "0"], "--reps 0"),
    ):
        assert calibrate.main([*args, *CALIBRATE_SHAPES]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "none.yaml").exists() and not (tmp_path / "catalogue").exists()
    # a file that would not load afterwards is left as it was: no half-written entry
    broken = tmp_path / "broken.yaml"
    broken.write_text(CPU_ENTRY)
    before = broken.read_text()
    with pytest.raises(Exception, match="measured"):
        calibrate.write(broken, "measured: {bandwidth: fast}")
    assert broken.read_text() == before and not (tmp_path / "broken.yaml.tmp").exists()
