"""python -m trainer.check: a policy's losses and gradients against none's on the composed model, and a broken policy
caught with the parameter that differs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CLI_ENV, ROOT
from trainer.check import group_of, main

SHRINK = ["seq_len=32", "batch_size=2", "measure.warmup_steps=1"]
LLAMA = [
    "model=llama-tiny",
    "model.n_layer=2",
    "model.n_embd=64",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.mlp_hidden=128",
    "model.dropout=0.1",
]


@pytest.mark.parametrize("policy", [["policy=selective"], ["policy=sqrt"], ["policy=op_sac", "accum=2"]])
def test_exact_policies_pass_bitwise(capsys: pytest.CaptureFixture[str], policy: list[str]) -> None:
    assert main([*LLAMA, *SHRINK, *policy]) == 0
    out = capsys.readouterr().out
    assert "compared bitwise" in out and "equal: every loss and gradient" in out
    assert "| model.layers.1 | 9 | 0 | 0 |" in out  # every tensor of a layer, no difference


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_fsdp2_mixed_precision_policies_pass_bitwise(capsys: pytest.CaptureFixture[str], family: str) -> None:
    """Under trainer=fsdp2 both modules are sharded (one rank) with FSDP2's bf16 MixedPrecisionPolicy, as the run
    shards them; none, full and both per-op policies give none's losses and gradients bitwise."""
    model = LLAMA if family == "llama" else ["model=micro", "model.dropout=0.1"]
    for policy in ("full", "op_sac", "torchtitan_sac"):
        assert main([*model, *SHRINK, "trainer=fsdp2", "precision=bf16-mixed", f"policy={policy}"]) == 0, policy
        out = capsys.readouterr().out
        assert "compared bitwise; precision bf16-mixed (FSDP2 MixedPrecisionPolicy" in out, out
        assert "both sharded by FSDP2" in out and "equal: every loss and gradient" in out


def test_auto_plans_first_then_compares(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*LLAMA, *SHRINK, "policy=auto", "policy.budget_mib=1000"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("policy=auto (plan [0-1]:none)")  # a roomy budget keeps everything


def test_a_policy_that_loses_the_dropout_masks_is_caught(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recompute without the RNG state draws new dropout masks: the gradients differ, and the check names where."""
    from torch.utils.checkpoint import checkpoint

    import trainer.policies.library as library

    def forgetful(fn: Any, *args: Any, context_fn: Any = None, **kwargs: Any) -> Any:
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    monkeypatch.setattr(library, "checkpointed", forgetful)
    assert main([*LLAMA, *SHRINK, "policy=full"]) == 1
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: policy=full differs from none: model."), err
    assert " at step 0: max |Δgrad| " in lines[0] and "differs: model." in out


def test_an_hf_model_is_checked_against_its_own_loss(
    capsys: pytest.CaptureFixture[str], hf_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """For an HF model the check also compares the training loss with the model's own forward (labels=): equal for
    Cohere, whose forward scales its logits, and caught when the head skips that scale."""
    from models.adapter import LogitTransform
    from models.hf import HFAdapter

    args = ["model=hf", f"model.name_or_path={hf_models['cohere']}", "model.attention=eager", *SHRINK]
    assert main([*args, "policy=full"]) == 0
    out = capsys.readouterr().out
    assert "the training loss vs the model's own forward" in out and "equal: every loss" in out
    monkeypatch.setattr(HFAdapter, "logit_transform", property(lambda self: LogitTransform()))
    assert main([*args, "policy=full"]) == 1
    out, err = capsys.readouterr()
    assert "is not the model's own forward's" in err and len(err.strip().splitlines()) == 1


def test_groups_are_layers_or_top_level_parts() -> None:
    assert group_of("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert group_of("transformer.h.0.attn.c_attn.bias") == "transformer.h.0"
    assert group_of("lm_head.weight") == "lm_head"
    assert group_of("model.embed_tokens.weight") == "model.embed_tokens"


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["policy=bogus"], "unknown policy 'bogus'"),
        (["policy=auto"], "needs a budget"),
        (["--steps", "0"], "--steps 0 must be ≥ 1"),
        (["--steps", "100000"], "micro-batches and the corpus has"),
        (["model=llama-tiny", "model.n_kv_head=3"], "not divisible by model.n_kv_head=3"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], args: list[str], fragment: str) -> None:
    try:
        code = main([*SHRINK, *args])
    except SystemExit as e:  # argparse's own refusals exit from inside main
        code = e.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    # A refusal that needs the corpus comes after it is read: a cold cache's tokenizing progress goes first.
    lines = [ln.rsplit("\r", 1)[-1] for ln in err.split("\n")]  # a progress bar ends by redrawing its line
    lines = [ln for ln in lines if ln and "examples/s]" not in ln]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err


@pytest.mark.slow
def test_cli_as_the_readme_says(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "trainer.check", *LLAMA, *SHRINK, "policy=auto", "policy.budget_mib=2.2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=CLI_ENV,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "equal: every loss and gradient under auto matches none (bitwise)" in r.stdout
