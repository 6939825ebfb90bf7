"""trainer/families/: the registry sweep's tiny configs, one family's row through the project's entry points, the
markdown it renders, and the docs block writer (docs/hf-families.md, where the table lives) with its refusal. The
sweep itself (every family) is a benchmark, not a test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from tests.conftest import CLI_ENV, ROOT  # noqa: E402
from trainer import families as hff  # noqa: E402
from trainer.families.sweep import HF_FAMILIES_PAGE  # noqa: E402

POLICIES = ["full", "selective"]


def test_the_registry_is_the_list() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    families = hff.registered_families()
    assert families == list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) and {"llama", "gpt2", "mamba"} <= set(families)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "jamba", "deepseek_v3", "mamba2"])
def test_tiny_configs_are_tiny_and_keep_their_kinds(family: str) -> None:
    import torch
    import transformers

    config, changed = hff.tiny_config(family)
    values = config.to_dict()
    assert values["vocab_size"] == hff.VOCAB
    with torch.device("meta"):
        params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    assert params < 1_000_000, params
    if family == "gemma2":  # sliding and full layers alternate: two layers keep both
        assert values["layer_types"] == ["sliding_attention", "full_attention"] and values["sliding_window"] <= 16
    if family == "jamba":  # a Mamba layer and an attention layer, the second one MoE
        assert (values["num_hidden_layers"], values["attn_layer_period"], values["attn_layer_offset"]) == (2, 2, 1)
    if family == "gpt2":
        assert (values["n_embd"], values["n_head"], values["n_layer"], values["attn_pdrop"]) == (64, 4, 2, 0.1)


def test_a_layer_pattern_is_cut_to_the_fewest_layers_that_keep_it() -> None:
    pattern = ["sliding", "sliding", "sliding", "full"] * 6
    values = {"num_hidden_layers": 24, "layer_types": pattern, "full_attn_idxs": [3, 7, 11], "mlp_only_layers": []}
    assert hff._layers(values) == {"num_hidden_layers": 4, "layer_types": pattern[:4], "full_attn_idxs": [3]}
    assert hff._layers(values, count=8)["full_attn_idxs"] == [3, 7]


def test_multimodal_and_encoder_decoder_families_are_refused_on_their_defaults() -> None:
    config = hff.default_config("git")
    assert "needs non-text inputs (vision_config" in (hff.non_text_reason("git", "GitForCausalLM", config) or "")
    assert "is an encoder-decoder" in (hff.non_text_reason("bart", "BartForCausalLM", hff.default_config("bart")) or "")
    assert hff.non_text_reason("llama", "LlamaForCausalLM", hff.default_config("llama")) is None


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Two families' rows, in this process, through the same function each sweep subprocess runs."""
    out = {}
    with hff.quiet():
        for family in ("llama", "gpt2"):
            out[family] = hff.family_row(family, POLICIES, ["none", "full"], tmp_path_factory.mktemp(family))
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_family_row_goes_through_the_projects_entry_points(rows: dict[str, dict[str, Any]], family: str) -> None:
    row = rows[family]
    assert row["status"] == "passed", row.get("traceback") or row["reason"]
    assert row["loads"] and row["attention"] == "eager" and row["n_layer"] == 2 and row["reason"] == ""
    assert row["class"] == {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[family]
    assert {p: c["result"] for p, c in row["checks"].items()} == {"full": "bitwise", "selective": "bitwise"}
    assert row["checks"]["full"]["detail"] == "[0-1]:full"
    for policy in ("none", "full"):
        e = row["estimate"][policy]
        assert abs(e["activation_off"]) <= hff.ESTIMATE_SLACK_BYTES and abs(e["peak_off"]) <= hff.ESTIMATE_SLACK_BYTES
        assert e["activation_bytes"] > 0
    assert row["loss"]["rel_diff"] <= hff.LOSS_TOLERANCE and row["loss"]["labels"] == "x"
    assert row["loss"]["own"] > 10  # the head's gain: logits of tens, so a transform after the head would show
    assert row["seconds"]["total"] > 0
    json.dumps(row)  # what the child writes


def test_results_and_markdown(rows: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    refused = hff.broken_row("git", "x", 1.0) | {"status": "refused", "reason": "inputs: GitForCausalLM needs images"}
    broken = hff.broken_row("bart", "timed out after 180 s", 180.0)
    meta = {
        "env": {
            "date": "2026-12-01",
            "transformers": "5.x",
            "torch": "2.x",
            "cpu": "AMD EPYC",
            "policies": POLICIES,
            "estimate_policies": ["none", "full"],
            "timeout_s": 180,
            "jobs": 1,
        },
        "command": "python -m trainer.families --families llama,gpt2,git,bart",
        "families": ["llama", "gpt2", "git", "bart"],
    }
    hff.write_results(tmp_path, [rows["llama"], rows["gpt2"], refused, broken], meta)
    md = (tmp_path / "summary.md").read_text()
    lines = md.splitlines()
    assert lines[0].startswith("Generated by `python -m trainer.families --families llama,gpt2,git,bart` (2026-12-01,")
    assert "transformers 5.x, torch 2.x, CPU AMD EPYC; policies checked: full, selective;" in lines[0]
    assert "**4 of 4 families**: 2 passed, 1 refused, 1 broken." in md
    table = [ln for ln in lines if ln.startswith("| `")]
    assert table == [  # broken first
        "| `bart` | BartForCausalLM | broken | process: timed out after 180 s |",
        "| `git` | GitForCausalLM | refused | inputs: GitForCausalLM needs images |",
    ]
    assert "Passed (2): `llama`, `gpt2`." in md
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["model_type"] for r in data["rows"]] == ["llama", "gpt2", "git", "bart"]
    csv = (tmp_path / "results.csv").read_text().splitlines()
    assert csv[0].startswith("model_type,class,status,stage,loads,attention,n_layer,params,check_full,check_selective")
    assert csv[1].startswith("llama,LlamaForCausalLM,passed,,True,eager,2,")


@pytest.mark.parametrize("flags", [("--write-docs", "--page"), ("--write-readme", "--readme")])  # and former names
def test_write_docs_refuses_without_the_markers(
    flags: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "hf-families.md"
    page.write_text("# a docs page without the markers\n")
    write, where = flags
    assert hff.main(["--families", "llama", write, where, str(page), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "has no <!-- hf-families:start -->" in err[0]
    assert page.read_text() == "# a docs page without the markers\n" and not (tmp_path / "rows.jsonl").exists()


def test_write_docs_replaces_the_block(rows: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    env = {"date": "d", "transformers": "t", "torch": "p", "cpu": "c", "policies": POLICIES, "estimate_policies": []}
    meta = {"env": {**env, "timeout_s": 1, "jobs": 1}, "command": "c", "families": ["llama"]}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "rows.jsonl").write_text(json.dumps(rows["llama"]) + "\n")
    page = tmp_path / "hf-families.md"
    page.write_text(f"before\n{hff.START}\nold\n{hff.END}\nafter\n")
    assert hff.main(["--render", str(tmp_path), "--write-readme", "--readme", str(page)]) == 0  # the former names
    text = page.read_text()
    assert text.startswith(f"before\n{hff.START}\nGenerated by `c`") and text.endswith(f"{hff.END}\nafter\n")
    assert "old" not in text and "Passed (1): `llama`." in text
    # the page the table lives in: a copy of docs/hf-families.md, its block replaced and the rest as it was
    copy = tmp_path / "docs-hf-families.md"
    copy.write_text(HF_FAMILIES_PAGE.read_text())
    assert hff.main(["--render", str(tmp_path), "--write-docs", "--page", str(copy)]) == 0
    before, after = HF_FAMILIES_PAGE.read_text(), copy.read_text()
    block = after.split(hff.START)[1].split(hff.END)[0]
    assert block == text.split(hff.START)[1].split(hff.END)[0]  # the same table
    assert after.split(hff.START)[0] == before.split(hff.START)[0]
    assert after.split(hff.END)[1] == before.split(hff.END)[1]
    assert after.count(hff.START) == after.count(hff.END) == 1


@pytest.mark.slow
def test_cli_sweeps_in_subprocesses_and_a_bad_family_is_one_line(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.families",
            "--families",
            "gpt2,git",
            "--policies",
            "full",
            "--estimate-policies",
            "none",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=CLI_ENV,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {json.loads(ln)["model_type"]: json.loads(ln) for ln in (tmp_path / "rows.jsonl").read_text().splitlines()}
    assert rows["gpt2"]["status"] == "passed" and rows["git"]["status"] == "refused"
    assert "[1/2] gpt2: passed" in r.stdout and (tmp_path / "logs" / "gpt2.log").is_file()
    bad = subprocess.run(
        [sys.executable, "-m", "trainer.families", "--families", "surely_not_a_family"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=CLI_ENV,
    )
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and "not in transformers' causal-LM registry" in lines[0]
