"""The real config composes for every option, and every bad value is refused with one line before any work."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from tests.conftest import CONF, SMALL, run_cli
from trainer.core.rundir import discard_run_dir
from trainer.core.schema import (
    Config,
    ConfigError,
    DataConfig,
    MeasureConfig,
    ModelConfig,
    OptimConfig,
    TrainerConfig,
    validate,
)
from trainer.loss import LossConfig
from trainer.policies import POLICIES, build_policy

POLICY_FILES = sorted(p.stem for p in (CONF / "policy").glob("*.yaml"))


def test_every_registered_policy_has_a_yaml_and_back() -> None:
    assert set(POLICY_FILES) == set(POLICIES)


@pytest.mark.parametrize("policy", POLICY_FILES)
def test_compose_every_policy(compose_cfg, policy: str) -> None:
    cfg = compose_cfg(f"policy={policy}", "accum=8")
    config = validate(cfg)
    assert isinstance(config, Config) and config.accum == 8
    assert build_policy(config.policy).cfg.name == policy


def _defaults(cls: type) -> dict[str, object]:
    """A dataclass's scalar defaults (nested dataclasses have their own)."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING and not dataclasses.is_dataclass(f.default_factory()):
            out[f.name] = f.default_factory()
    return out


def _repeats(written: dict | None, cls: type) -> list[str]:
    defaults = _defaults(cls)
    return [
        key
        for key, value in (written or {}).items()
        if key in defaults and type(value) is type(defaults[key]) and value == defaults[key]
    ]


def test_no_yaml_repeats_a_dataclass_default() -> None:
    """One source of truth: a default lives in trainer/core/schema.py (or the loss head's config), and a yaml holds
    only what its option changes, so changing a default is one edit and no option keeps the old one silently."""
    groups = {"model": ModelConfig, "data": DataConfig, "trainer": TrainerConfig, "loss": LossConfig}
    found = {
        f"conf/{group}/{path.name}": _repeats(yaml.safe_load(path.read_text()), cls)
        for group, cls in groups.items()
        for path in sorted((CONF / group).glob("*.yaml"))
    }
    top = yaml.safe_load((CONF / "config.yaml").read_text())
    found["conf/config.yaml"] = _repeats(top, Config)
    for section, cls in {"optim": OptimConfig, "measure": MeasureConfig}.items():
        found[f"conf/config.yaml {section}"] = _repeats(top.get(section), cls)
    assert {where: keys for where, keys in found.items() if keys} == {}


MANDATORY = {("data", "local"): "data.path=[somewhere.txt]"}
MANDATORY |= {("loss", name): "seq_len=256" for name in ("chunked", "fused")}  # 1024 tokens: the chunk fits


@pytest.mark.parametrize("group", ["model", "data", "trainer", "loss"])
def test_compose_every_option_of(compose_cfg, hf_models, group: str) -> None:
    """Every option of the group composes, and what it composes is what its yaml says, key by key; a null the
    validation settles (model=hf's attention: Gemma-2 has no SDPA, so eager) is what it settles to."""
    mandatory = MANDATORY | {("model", "hf"): f"model.name_or_path={hf_models['gemma2']}"}
    settled = {("model", "hf", "attention"): "eager"}
    options = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    assert options
    for option in options:
        overrides = [f"{group}={option}", "seq_len=32"]  # a later seq_len= wins
        if (group, option) in mandatory:
            overrides.append(mandatory[(group, option)])
        node = getattr(validate(compose_cfg(*overrides, small=False)), group)
        written = yaml.safe_load((CONF / group / f"{option}.yaml").read_text()) or {}
        for key, value in written.items():
            if value == "???":
                continue
            value = settled.get((group, option, key), value)
            assert getattr(node, key) == value, f"{group}={option}: {key} is {getattr(node, key)!r}, yaml {value!r}"


def test_defaults_are_the_documented_ones(compose_cfg) -> None:
    config = validate(compose_cfg(small=False))
    assert config.precision == "auto"  # settled per machine at start (trainer/precision.py)
    assert config.policy["name"] == "none" and config.loss.name == "standard"
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
        (["model=llama-tiny", "model.n_kv_head=3"], "model.n_head=8 is not divisible by model.n_kv_head=3"),
        (["model=llama-tiny", "model.n_head=6"], "model.n_embd=256 / model.n_head=6"),
        (["model.family=mamba"], "model.family='mamba'"),
        (["model=hf"], "model.name_or_path"),
        (["loss.name=bogus"], "loss='bogus' is unknown; choose one of: standard, chunked, fused"),
        (["loss=chunked", "loss.chunk_tokens=0"], "loss.chunk_tokens=0 must be ≥ 1"),
        (["loss=chunked", "loss.chunk_tokens=1000"], "loss.chunk_tokens=1000 is larger than the micro-batch's 128"),
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
    (["model=nope"], "unknown model 'nope'; choose one of:"),
    (["loss=nope"], "unknown loss 'nope'; choose one of: chunked, fused, standard"),
    (["loss=chunked", "loss.chunk_tokens=0"], "loss.chunk_tokens=0 must be ≥ 1"),
    (["model=llama-tiny", "model.n_kv_head=3"], "not divisible by model.n_kv_head=3"),
    (["model=hf", "model.name_or_path=/nonexistent/folder"], "no such folder"),
    (["data.tokenizer=model"], "data.tokenizer=model uses a Hugging Face model's tokenizer"),
    (["trainer.devices=0"], "Lightning refuses it: Trainer(devices=0) value is not a valid input"),
    (["trainer.max_steps=2", "measure.snapshot_step=5"], "measure.snapshot_step=5 is never reached"),
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


def test_a_refused_run_takes_the_empty_folders_hydra_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "2026-12-01" / "earlier").mkdir(parents=True)  # another run's folder: kept
    for name in ("12-00-00_full", "12-00-01_none"):
        (tmp_path / "runs" / "2026-12-02" / name / ".hydra").mkdir(parents=True)
        (tmp_path / "runs" / "2026-12-02" / name / "train.log").write_text("")
    discard_run_dir(Path("runs/2026-12-02/12-00-00_full"))
    assert [p.name for p in (tmp_path / "runs" / "2026-12-02").iterdir()] == ["12-00-01_none"]  # not empty: kept
    discard_run_dir(Path("runs/2026-12-02/12-00-01_none"))
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["2026-12-01"]
    discard_run_dir(Path("runs/2026-12-01/earlier"))  # an empty folder is also nothing but Hydra's
    assert list(tmp_path.iterdir()) == []  # up to the working directory, which stays


@pytest.mark.slow
def test_cli_cfg_job_composes() -> None:
    r = run_cli("policy=selective", "accum=8", "--cfg", "job")
    assert r.returncode == 0, r.stderr
    assert "accum: 8" in r.stdout and "name: selective" in r.stdout
