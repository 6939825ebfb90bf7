"""The real config composes for every option, and every bad value is refused with one line before any work."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import CONF, SMALL, run_cli
from trainer.policies import POLICIES, build_policy
from trainer.schema import Config, ConfigError, validate

POLICY_FILES = sorted(p.stem for p in (CONF / "policy").glob("*.yaml"))


def test_every_registered_policy_has_a_yaml_and_back() -> None:
    assert set(POLICY_FILES) == set(POLICIES)


@pytest.mark.parametrize("policy", POLICY_FILES)
def test_compose_every_policy(compose_cfg, policy: str) -> None:
    cfg = compose_cfg(f"policy={policy}", "accum=8")
    config = validate(cfg)
    assert isinstance(config, Config) and config.accum == 8
    assert build_policy(config.policy).cfg.name == policy


@pytest.mark.parametrize("group", ["model", "data", "trainer"])
def test_compose_every_option_of(compose_cfg, group: str) -> None:
    for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
        overrides = [f"{group}={option}", "seq_len=32"]
        if group == "data" and option == "local":
            overrides.append("data.path=[somewhere.txt]")
        config = validate(compose_cfg(*overrides, small=False))
        assert getattr(config, group).name if group != "data" else config.data.source


def test_defaults_are_the_documented_ones(compose_cfg) -> None:
    config = validate(compose_cfg(small=False))
    assert config.precision == "bf16-mixed"
    assert config.policy["name"] == "none"
    assert config.model.name == "tiny" and config.data.source == "embedded"


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["accum=0"], "accum=0 must be ≥ 1"),
        (["batch_size=0"], "batch_size=0 must be ≥ 1"),
        (["seq_len=4096"], "exceeds model.block_size"),
        (["model.n_head=3"], "not divisible"),
        (["model.dropout=1.0"], "model.dropout"),
        (["precision=fp8"], "precision='fp8'"),
        (["trainer.max_steps=0"], "trainer.max_steps"),
        (["optim.min_lr=1.0"], "min_lr"),
    ],
)
def test_validate_refuses_with_one_line(compose_cfg, overrides: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(*overrides))
    assert fragment in str(e.value) and "\n" not in str(e.value)


# One subprocess per mistake a user can type: the real CLI, exit status 2, one line, no run folder left.
BAD_COMMAND_LINES = [
    (["accum=abc"], "accum"),
    (["accum=0"], "accum=0 must be ≥ 1"),
    (["foo=1"], "unknown config key 'foo'"),
    (["policy=bogus"], "unknown policy 'bogus'; choose one of:"),
    (["policy=every_k", "policy.k=0"], "policy.k=0 must be between 1"),
    (["policy=per_block", "policy.pattern=[full,oops]"], "unknown treatment 'oops'"),
    (["data=local", "data.path=[/nonexistent/corpus.txt]"], "does not exist"),
    (["data=wikitext103"], "offline"),
    (["seq_len=4096"], "exceeds model.block_size"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args, fragment", BAD_COMMAND_LINES, ids=[" ".join(a) for a, _ in BAD_COMMAND_LINES])
def test_cli_bad_input_is_one_line(tmp_path: Path, args: list[str], fragment: str) -> None:
    run_dir = tmp_path / "run"
    r = run_cli(*SMALL, *args, f"hydra.run.dir={run_dir}")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and fragment in lines[0], lines[0]
    assert "Traceback" not in r.stderr + r.stdout
    assert not run_dir.exists(), "a refused run must leave nothing behind"


@pytest.mark.slow
def test_cli_cfg_job_composes() -> None:
    r = run_cli("policy=selective", "accum=8", "--cfg", "job")
    assert r.returncode == 0, r.stderr
    assert "accum: 8" in r.stdout and "name: selective" in r.stdout
