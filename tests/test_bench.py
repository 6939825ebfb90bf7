"""bench/policies.py end to end on the micro shape, and the README block writer."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import policies as bench
from bench._readme import replace_block
from bench.policy_table import policy_configs
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("bench")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = bench.main(["--model", "micro", "--rounds", "2", "--overhead-steps", "3", "--out", str(out)])
    assert rc == 0
    return out, stdout.getvalue()


def test_writes_one_row_per_policy_and_the_overhead_row(micro_run: tuple[Path, str]) -> None:
    out, printed = micro_run
    data = json.loads((out / "results.json").read_text())
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    skipped = set(data["meta"]["skipped_policies"])
    expected = [n for n in policy_configs() if n not in skipped]
    assert [r["name"] for r in rows if r["kind"] == "policy"] == expected
    assert [r["name"] for r in rows if r["kind"] == "overhead"] == ["lightning_vs_bare"]
    assert len(rows) == len(data["rows"]) == len(expected) + 1
    by = {r["name"]: r for r in data["rows"]}
    assert by["none"]["step_ratio"] == pytest.approx(1.0) and by["none"]["flops_ratio"] == 1.0
    for name in expected:
        r = by[name]
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["activation_mib"] > 0
        assert r["peak_total_mib"] > r["activation_mib"]  # weights, gradients and AdamW state on top
        assert len(data["samples"]["step_s"][name]) == 2  # one step per round
    # The recompute policies pay FLOPs and save activation memory; `full` recomputes one whole forward.
    assert by["full"]["flops_ratio"] > 1.2 and by["full"]["activation_ratio"] < 1
    assert 1 < by["selective"]["flops_ratio"] < by["full"]["flops_ratio"]
    o = by["lightning_vs_bare"]
    assert o["pairs"] == 3 and o["bare_step_ms"] > 0 and o["lightning_step_ms"] > 0 and o["step_ratio"] > 0
    assert [t["target"].split()[0] for t in data["targets"]] == ["full", "selective", "Lightning", "activation"]
    assert all(t["met"] in (True, False) for t in data["targets"])
    # The estimator's columns, when it is there, are numbers beside the measured ones.
    if data["meta"]["estimator"] == "trainer.estimate.estimate":
        assert all(by[n]["est_activation_mib"] > 0 and by[n]["est_peak_total_mib"] > 0 for n in expected)
    # What is printed: the table, the overhead table and the targets; table.md holds the same.
    assert "| policy | step ms | × none |" in printed and "| Lightning `Trainer.fit` |" in printed
    assert "Targets (reported, not asserted):" in printed
    assert (out / "table.md").read_text().strip() in printed


def test_the_estimator_columns_read_n_a_without_it(
    micro_run: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "trainer.estimate", None)  # import fails as if the module did not exist
    setup = bench.make_setup(bench.parse_args(["--model", "micro"]))
    est, why = bench.estimates(setup)
    assert est == {} and why is not None and "trainer.estimate not importable" in why
    result = json.loads((micro_run[0] / "results.json").read_text())
    for r in result["rows"]:
        r.update(est_activation_mib=None, est_peak_total_mib=None, est_flops_ratio=None)
    lines = [line for line in bench.table(result).splitlines() if line.startswith("| `")]
    assert lines and all(line.count("n/a") == 4 for line in lines)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_device_fails_in_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.policies", "--device", "cuda", "--model", "gpt2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda: no CUDA device"), proc.stderr


def test_readme_writer_replaces_only_the_marked_block(tmp_path: Path) -> None:
    start, end = bench.START, bench.END
    readme = tmp_path / "README.md"
    before = "# title\n\n<!-- policy-table:start -->\nother block\n<!-- policy-table:end -->\n\n## Bench\n\n"
    after = "\n\ntrailing text\n"
    readme.write_text(f"{before}{start}\nold table\n{end}{after}")
    replace_block(readme, start, end, "new table\nline 2", bench.HEADING)
    assert readme.read_text() == f"{before}{start}\nnew table\nline 2\n{end}{after}"
    replace_block(readme, start, end, "newer", bench.HEADING)  # again: still one block, the rest untouched
    assert readme.read_text() == f"{before}{start}\nnewer\n{end}{after}"

    # No markers yet: a section holding them is appended; the old text stays as it was.
    fresh = tmp_path / "FRESH.md"
    fresh.write_text("# title\n\nbody\n")
    replace_block(fresh, start, end, "table", bench.HEADING)
    assert fresh.read_text() == f"# title\n\nbody\n\n{bench.HEADING}\n\n{start}\ntable\n{end}\n"

    # The older benchmark writes its own block through the same helper and leaves this one alone.
    from bench import policy_table

    policy_table.write_readme("policy rows", readme)
    text = readme.read_text()
    assert "<!-- policy-table:start -->\npolicy rows\n<!-- policy-table:end -->" in text
    assert f"{start}\nnewer\n{end}" in text


def test_command_line_to_rerun_drops_the_output_folder() -> None:
    args: list[Any] = ["--model", "gpt2", "--out", "/tmp/x", "--device", "cuda", "--write-readme", "--out=/y"]
    assert bench.command_line(args) == "python -m bench.policies --model gpt2 --device cuda"
