"""The sweep report on hand-made job folders: every status, ratios, budget, CSV, plots; no training here."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT
from trainer.report import build_report, main, read_jobs
from trainer.report.plots import pareto_front, point_positions

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_job(
    root: Path,
    num: int,
    policy: str,
    batch_size: int,
    accum: int,
    summary: dict[str, Any] | None,
    *,
    precision: str = "bf16-mixed",
    curve: list[float] | None = None,
    val: list[float] | None = None,
    scalars: dict[str, list[float]] | None = None,
) -> Path:
    """A Hydra job folder as train.py leaves it: .hydra/, summary.json (unless None), optional TB events."""
    job = root / f"{num}_micro={batch_size}x{accum},policy={policy}"
    (job / ".hydra").mkdir(parents=True)
    config = {
        "model": {"name": "micro", "n_layer": 2},
        "policy": {"name": policy},
        "accum": accum,
        "batch_size": batch_size,
        "precision": precision,
        "seq_len": 32,
        "loss": {"name": "standard"},
    }
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (job / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"job": {"num": num}}}))
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"micro={batch_size}x{accum}", f"policy={policy}"]))
    if summary is not None:
        full = {
            "policy": policy,
            "accum": accum,
            "batch_size": batch_size,
            "precision": precision,
            "seq_len": 32,
            "loss": {"name": "standard", "chunk_tokens": 1024},
        }
        full.update({"model": {"name": "micro"}, "device": "cpu", **summary})
        (job / "summary.json").write_text(json.dumps(full))
    series = dict(scalars or {})
    if curve:
        series["train/loss"] = curve
    if series or val:
        from torch.utils.tensorboard import SummaryWriter

        # events in the job folder, as runs write them; a job without a summary (killed) in tb/, as older runs did
        w = SummaryWriter(str(job if summary is not None else job / "tb"))
        for tag, values in series.items():
            for step, v in enumerate(values, start=1):
                w.add_scalar(tag, v, step)
        for step, v in enumerate(val or [], start=1):
            w.add_scalar("val/loss", v, step * 2)
        w.close()
    return job


def done(act: float, step_ms: float, tps: float, loss: float = 4.0, **more: Any) -> dict[str, Any]:
    return {
        "status": "completed",
        "steps": 6,
        "activation_peak_mib": act,
        "peak_allocated_mib": None,
        "median_step_ms": step_ms,
        "tokens_per_s": tps,
        "final_train_loss": loss,
        "final_val_loss": loss + 0.1,
        **more,
    }


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """Nine jobs: six completed (one split without a `none` job of its own), one oom, one error, one killed."""
    root = tmp_path / "sweep"
    root.mkdir()
    c = [5.0, 4.6, 4.3]
    make_job(root, 0, "full", 8, 1, done(2.0, 150.0, 1700.0), curve=c, val=[4.5])
    make_job(root, 1, "none", 8, 1, done(8.0, 100.0, 2560.0), curve=c, val=[4.5])
    make_job(root, 2, "selective", 8, 1, done(5.0, 110.0, 2300.0), curve=c, val=[4.5])
    make_job(root, 3, "none", 4, 2, done(4.0, 120.0, 2100.0), curve=c)
    make_job(root, 4, "full", 4, 2, done(1.0, 160.0, 1600.0), curve=c)
    make_job(root, 5, "full", 2, 4, done(0.5, 200.0, 1280.0), curve=c)  # no `none` at 2x4: vs job 1
    make_job(
        root,
        6,
        "offload",
        8,
        1,
        {
            "status": "oom",
            "error": "RuntimeError: can't allocate memory\nsecond line",
            "steps": 2,
            "activation_peak_mib": 9.5,
            "median_step_ms": None,
            "tokens_per_s": None,
        },
        curve=[5.0, 4.7],
    )
    make_job(root, 7, "op_sac", 8, 1, {"status": "error", "error": "ValueError: boom"})
    make_job(
        root,
        8,
        "per_block",
        2,
        4,
        None,
        curve=[5.0],
        scalars={"memory/activation_peak_mib": [0.7], "time/step_ms": [300.0, 250.0]},
    )  # killed: figures only in its events
    return root


def by_policy(jobs: list) -> dict[str, Any]:
    return {j.policy: j for j in jobs if j.status != "completed" or j.batch_size == 8}


def test_rows_are_sorted_completed_by_policy_then_failures(sweep: Path) -> None:
    jobs = read_jobs(sweep)
    order = [(j.status, j.policy, j.batch_size) for j in jobs]
    assert order == [
        ("completed", "none", 8),
        ("completed", "none", 4),
        ("completed", "selective", 8),
        ("completed", "full", 8),
        ("completed", "full", 4),
        ("completed", "full", 2),
        ("oom", "offload", 8),
        ("error", "op_sac", 8),
        ("missing", "per_block", 2),
    ]


def test_ratios_compare_with_the_none_job_of_the_same_split(sweep: Path) -> None:
    report = build_report(sweep)
    assert report.metric == "activation_peak_mib"  # CPU jobs: no CUDA peak
    jobs = {(j.policy, j.batch_size): j for j in report.jobs}
    sel = jobs[("selective", 8)]
    assert sel.baseline is jobs[("none", 8)] and sel.baseline_exact
    assert sel.mem_ratio == pytest.approx(5.0 / 8.0) and sel.time_ratio == pytest.approx(1.1)
    full4 = jobs[("full", 4)]
    assert full4.baseline is jobs[("none", 4)] and full4.mem_ratio == pytest.approx(0.25)
    full2 = jobs[("full", 2)]  # no none at 2x4: the overall none job, marked
    assert full2.baseline is jobs[("none", 8)] and not full2.baseline_exact
    assert full2.mem_ratio == pytest.approx(0.5 / 8.0)
    row = next(line for line in report.markdown.splitlines() if line.startswith("| 5 |"))
    assert "0.06×*" in row and "2.00×*" in row


def test_every_status_has_a_row_with_what_it_reached(sweep: Path) -> None:
    report = build_report(sweep)
    rows = {j.policy: j for j in report.jobs}
    oom = rows["offload"]
    assert oom.status == "oom" and oom.get("activation_peak_mib") == 9.5 and oom.get("steps") == 2
    assert oom.error == "RuntimeError: can't allocate memory"  # one line
    assert oom.get("final_train_loss") == pytest.approx(4.7) and "final_train_loss" in oom.from_events
    assert rows["op_sac"].status == "error" and rows["op_sac"].error == "ValueError: boom"
    killed = rows["per_block"]
    assert killed.status == "missing" and "no summary.json" in (killed.error or "")
    assert killed.get("activation_peak_mib") == pytest.approx(0.7)  # from its events
    assert killed.get("median_step_ms") == pytest.approx(250.0)  # first (warm-up) step left out
    md = report.markdown
    assert "| oom† |" in md and "| error |" in md and "| missing† |" in md
    assert "**oom**: RuntimeError: can't allocate memory" in md
    assert "![memory vs throughput](pareto.png)" in md


def test_completed_rows_have_every_number(sweep: Path) -> None:
    report = build_report(sweep)
    for line in report.markdown.splitlines():
        if line.startswith("| ") and "| completed |" in line:
            cells = [c.strip() for c in line.strip("|").split("|")]
            # peak alloc is CUDA's: "—" on CPU; every other cell holds a value
            assert [i for i, c in enumerate(cells) if c == "—"] == [9], line


def test_csv_parses_with_raw_numbers(sweep: Path) -> None:
    report = build_report(sweep)
    with report.paths["report.csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 9
    assert [r["status"] for r in rows].count("completed") == 6
    first = rows[0]
    assert first["policy"] == "none" and float(first["tokens_per_s"]) == 2560.0
    assert float(first["mem_ratio_vs_none"]) == 1.0 and first["baseline_job"] == "1"
    assert rows[6]["status"] == "oom" and rows[6]["tokens_per_s"] == ""


def test_plots_are_png_with_one_point_per_job(sweep: Path) -> None:
    from matplotlib import image

    report = build_report(sweep)
    assert report.pareto_points == 9
    assert report.loss_lines == 8 + 3  # train/loss of every job but the error one; val/loss of three

    for name in ("pareto.png", "loss_curves.png"):
        data = report.paths[name].read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        pixels = image.imread(report.paths[name])
        assert pixels.ndim == 3 and pixels.shape[0] > 300 and pixels.shape[1] > 500


def test_oom_point_sits_at_the_memory_it_reached(sweep: Path) -> None:
    jobs = read_jobs(sweep)
    where, edge, edge_used = point_positions(jobs, "activation_peak_mib")
    rows = {j.policy: j for j in jobs}
    assert where[id(rows["offload"])] == (9.5, 0.0)  # memory reached; no throughput: on the axis
    assert where[id(rows["op_sac"])] == (edge, 0.0) and edge > 9.5 and edge_used  # nothing measured: right edge


def test_pareto_front_keeps_only_undominated_points() -> None:
    points = [(8.0, 2560.0), (5.0, 2300.0), (2.0, 1700.0), (1.0, 1600.0), (4.0, 2100.0), (6.0, 2000.0)]
    assert pareto_front(points) == [(1.0, 1600.0), (2.0, 1700.0), (4.0, 2100.0), (5.0, 2300.0), (8.0, 2560.0)]


def test_budget_names_the_fastest_job_that_fits(sweep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(sweep), "--budget", "4.5"]) == 0
    out = capsys.readouterr().out
    assert "Best within 4.5 MiB of activation peak (`activation_peak_mib`): none at micro-batch 4 × accum 2" in out
    assert "| 1 | none | standard | 8 | 1 | bf16-mixed | completed |" in out  # the table is printed too
    report = build_report(sweep, budget=0.1)
    assert report.budget is not None and report.budget.startswith("No completed job fits 0.1 MiB")
    assert "full at micro-batch 2 × accum 4: 0.50 MiB" in report.budget
    assert "## Budget" in report.paths["report.md"].read_text()


def test_gpu_jobs_are_judged_by_cuda_peak_allocated(tmp_path: Path) -> None:
    make_job(tmp_path, 0, "none", 8, 1, done(8.0, 10.0, 9000.0, peak_allocated_mib=900.0))
    make_job(tmp_path, 1, "full", 8, 1, done(2.0, 13.0, 7000.0, peak_allocated_mib=500.0))
    report = build_report(tmp_path, budget=600)
    assert report.metric == "peak_allocated_mib"
    assert report.budget is not None and "**full**" in report.budget and "CUDA peak allocated" in report.budget
    assert {j.policy: j.mem_ratio for j in report.jobs}["full"] == pytest.approx(500 / 900)


def test_a_single_run_folder_is_a_one_row_report(tmp_path: Path) -> None:
    run = make_job(tmp_path, 0, "selective", 4, 2, done(3.0, 90.0, 1000.0), curve=[5.0, 4.0], val=[4.2])
    report = build_report(run, budget=10)
    assert len(report.jobs) == 1 and report.jobs[0].name == run.name
    assert report.pareto_points == 1 and report.loss_lines == 2
    assert (run / "report.md").is_file() and (run / "pareto.png").read_bytes().startswith(PNG_SIGNATURE)
    assert report.jobs[0].mem_ratio is None  # no `none` job to compare with: "—"


def test_a_folder_without_jobs_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no job folders" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--budget", "abc"], "invalid float value: 'abc'"),
        (["--budget", "-5"], "--budget -5.0 must be a positive number of MiB"),
        (["--budget", "nan"], "--budget nan must be a positive number"),
        (["--metric", "bogus"], "invalid choice: 'bogus'"),
        (["--out", "FILE"], "File exists"),  # a file where the report's folder goes
    ],
)
def test_bad_report_arguments_are_one_line(
    sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], fragment: str
) -> None:
    (tmp_path / "FILE").write_text("mine")
    extra = [str(tmp_path / "FILE") if a == "FILE" else a for a in extra]
    try:
        code = main([str(sweep), *extra])
    except SystemExit as e:  # argparse's refusals exit from inside main
        code = e.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err and len(err.splitlines()) == 1, err
    assert (tmp_path / "FILE").read_text() == "mine"  # nothing overwritten


def test_cli_runs_as_a_module(sweep: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "trainer.report", str(sweep), "--budget", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "9 jobs: 6 completed, 1 oom, 1 error, 1 missing" in r.stdout
    assert "Best within 2 MiB" in r.stdout and "full at micro-batch 8 × accum 1" in r.stdout
    for name in ("report.md", "report.csv", "pareto.png", "loss_curves.png"):
        assert (sweep / name).is_file(), name
