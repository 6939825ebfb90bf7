"""`python -m trainer.export`: each target's settings checked by that target's own code where it is installed
(megatron-core's TransformerConfig, torchtitan's parser and per-op policy, transformers' TrainingArguments and
Trainer, Lightning's FSDPStrategy, torchtune's recipe keys and wrapper), the fidelity rows and figures, the refusals.

The target packages are the `export` extra; a test that needs a missing one is skipped and says which."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import CLI_ENV, ROOT
from trainer.core.schema import compose_config
from trainer.export import ExportRefused, ExportResult, export, main
from trainer.export.spec import APPROX, EXACT, NOT, elements
from trainer.policies import Plan, Segment

TINY = ["model=tiny", "model.n_embd=64", "model.n_head=2", "seq_len=16", "batch_size=2"]  # GPT, dropout 0.1
LLAMA = [
    "model=llama-tiny",
    "model.n_embd=64",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.mlp_hidden=128",
    "seq_len=16",
    "batch_size=2",
]
EVERY_SECOND = ["policy=per_block", "policy.pattern=[none,full]"]  # blocks 1, 3, 5 checkpointed


@functools.cache
def exported(to: str, *overrides: str, version: str | None = None) -> ExportResult:
    return export(compose_config(list(overrides)), to, version)


# ---- Megatron -------------------------------------------------------------------------------------


def test_megatron_first_k_is_the_block_method_exactly() -> None:
    form = exported("megatron", *LLAMA, "policy=first_k", "policy.k=2").forms[0]
    assert form.verdict == EXACT and form.ours is None  # exact: no figures needed
    assert form.chosen.settings == {
        "recompute_granularity": "full",
        "recompute_method": "block",
        "recompute_num_layers": 2,
    }
    assert form.text == "--recompute-granularity full --recompute-method block --recompute-num-layers 2"
    assert [r.element for r in form.rows] == ["blocks 0-1: full", "blocks 2-5: none", "loss head: standard"]


def test_megatron_every_k_is_uniform_and_says_how_its_last_group_differs() -> None:
    """Ours and megatron-core 0.19.2's uniform both make consecutive groups of k from layer 0, the last one shorter
    (0.19.2 clamps it); 0.16.1's loop has no clamp, so a k that does not divide num_layers is flagged."""
    even = exported("megatron", *TINY, "policy=every_k", "policy.k=2").forms[0]
    assert even.verdict == EXACT and "--recompute-method uniform --recompute-num-layers 2" in even.text
    assert "last group" not in even.rows[0].how
    odd = exported("megatron", *TINY, "policy=every_k", "policy.k=4").forms[0]
    assert odd.verdict == EXACT and odd.chosen.settings["recompute_num_layers"] == 4
    assert odd.rows[0].element == "blocks 0-5: full, groups of 4 (one checkpoint each)"
    assert "the last group has 2 layers" in odd.rows[0].how and "0.16.1" in odd.rows[0].how
    # only a group ending the plan is the groups' shorter last one: a lone block after a group is its own element
    mixed = Plan((Segment(0, 2, "full"), Segment(2, 3, "full"), Segment(3, 4, "full")))
    assert [(e.start, e.stop, e.group) for e in elements(mixed)] == [(0, 2, 2), (2, 4, 1)]


def test_megatron_op_sac_is_approximated_with_both_figures() -> None:
    form = exported("megatron", *TINY, "policy=op_sac").forms[0]
    assert form.verdict == APPROX and form.chosen.settings == {"recompute_granularity": "selective"}
    assert "no per-op policy" in form.rows[0].how
    assert form.ours and form.closest and (form.ours.plan, form.closest.plan) == ("[0-5]:op_sac", "[0-5]:selective")
    assert form.ours.flops > 0 and form.closest.activation_bytes > 0
    # On this model Megatron's selective (attention only) peaks above our op_sac: a plan that does fit is named
    # beside it. Asserted, not conditioned: a condition that stops holding would skip the check silently.
    assert form.closest.peak_bytes > form.ours.peak_bytes
    assert any("--recompute-granularity full" in n and "fits" in n for n in form.notes), form.notes


def test_megatron_settings_are_what_its_transformer_config_takes() -> None:
    core = pytest.importorskip("megatron.core", reason="megatron-core is not installed (the `export` extra)")
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = {"num_layers": 6, "hidden_size": 64, "num_attention_heads": 2}
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    for policy in (
        ["policy=first_k", "policy.k=2"],
        ["policy=every_k", "policy.k=2"],
        ["policy=op_sac"],
        ["policy=full"],
        ["policy=offload"],
    ):
        form = exported("megatron", *TINY, *policy).forms[0]
        TransformerConfig(**base, **form.chosen.settings)  # accepted
        for flag in form.text.split():
            if flag.startswith("--"):  # each flag is a field's name, as megatron.training makes its flags
                assert flag[2:].replace("-", "_") in fields, (core.__version__, flag)
    for bad in (
        {"recompute_granularity": "full"},
        {"recompute_granularity": "selective", "recompute_num_layers": 2},
        {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
            "cpu_offloading": True,
            "cpu_offloading_num_layers": 2,
        },
        {"cpu_offloading": True, "cpu_offloading_num_layers": 6},
    ):
        with pytest.raises(ValueError):
            TransformerConfig(**base, **bad)


TP = ["trainer=fsdp2", "trainer.devices=4", "trainer.tensor_parallel=2"]


def test_megatron_tensor_parallel_is_its_own_model_parallel_fields() -> None:
    """trainer.tensor_parallel=2 (SP on, off) as megatron.training's flags: each a ModelParallelConfig field that
    TransformerConfig inherits and accepts; sequence parallelism a switch, written only when on."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the `export` extra)")
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    for sp, switch in ((True, " --sequence-parallel"), (False, "")):
        form = exported("megatron", *LLAMA, *TP, f"trainer.sequence_parallel={sp}", "policy=full").forms[0]
        settings = form.chosen.settings
        assert settings["tensor_model_parallel_size"] == 2 and settings["sequence_parallel"] is sp
        assert form.text.endswith("--tensor-model-parallel-size 2" + switch), form.text
        TransformerConfig(**base, **settings)  # accepted


# ---- torchtitan -----------------------------------------------------------------------------------


def test_torchtitan_first_k_is_not_expressible_on_main_and_costs_the_closest() -> None:
    answer = exported("torchtitan", *TINY, "policy=first_k")
    main_form, toml_form = answer.forms
    assert main_form.version.key == "0.3" and toml_form.version.key == "0.2"
    assert main_form.verdict == NOT and "one mode on every block" in main_form.rows[1].how
    assert main_form.text.splitlines()[0].split()[-1].startswith("activation-checkpoint:")  # after --training.*
    assert main_form.ours and main_form.closest and main_form.ours.plan == "[0-1]:full [2-5]:none"
    assert main_form.closest.plan != main_form.ours.plan
    assert toml_form.text.startswith("[activation_checkpoint]\nmode = ")


def test_torchtitan_every_second_block_is_exact_in_toml_and_main_is_refused_when_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    toml_form = exported("torchtitan", *TINY, *EVERY_SECOND).forms[1]
    assert toml_form.verdict == EXACT
    assert toml_form.chosen.settings["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "2"}
    assert main(["--to", "torchtitan", "--target-version", "0.3", *TINY, *EVERY_SECOND]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torchtitan 0.3.0 (main" in err and "--target-version 0.2" in err, err


def test_torchtitan_toml_parses_as_toml() -> None:
    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11 has no tomllib")
    toml_form = exported("torchtitan", *TINY, *EVERY_SECOND).forms[1]
    assert tomllib.loads(toml_form.text) == toml_form.chosen.settings  # its one key, activation_checkpoint
    split = exported("torchtitan", *LLAMA, *TP, "policy=full").forms[1]
    assert tomllib.loads(split.text)["parallelism"] == {"tensor_parallel_degree": 2, "enable_sequence_parallel": True}


def test_torchtitan_arguments_parse_with_its_own_parser() -> None:
    ac = pytest.importorskip(
        "torchtitan.distributed.activation_checkpoint", reason="torchtitan is not installed (the `export` extra)"
    )
    import tyro
    from torchtitan.config.manager import custom_registry

    # Trainer.Config declares the field so (read from the installed source: importing it needs triton)
    trainer_src = Path(importlib.util.find_spec("torchtitan").origin).parent / "trainer.py"  # type: ignore[arg-type]
    assert "activation_checkpoint: ActivationCheckpointingConfig = field(" in trainer_src.read_text()

    from torchtitan.config.configs import TrainingConfig

    field = dataclasses.field(default_factory=ac.SelectiveAC.Config)  # Trainer.Config's own field and default
    training = dataclasses.field(default_factory=TrainingConfig)
    Config = dataclasses.make_dataclass(
        "Config",
        [("activation_checkpoint", ac.ActivationCheckpointingConfig, field), ("training", TrainingConfig, training)],
    )

    kinds = {"none": type(None), "full": ac.FullAC.Config, "selective": ac.SelectiveAC.Config}
    for policy, mode in (("none", "none"), ("full", "full"), ("op_sac", "selective")):
        form = exported("torchtitan", *TINY, f"policy={policy}").forms[0]
        assert form.chosen.settings["activation_checkpoint"] == mode
        parsed = tyro.cli(Config, args=form.chosen.settings["args"], registry=custom_registry)
        assert isinstance(parsed.activation_checkpoint, kinds[mode])
    # The precision travels: FSDP2's bf16 policy is torchtitan's mixed_precision_param/reduce; fp32 and pure bf16 too
    for ours, fields in (
        (["trainer=fsdp2", "precision=bf16-mixed"], {"mixed_precision_param": "bfloat16", "dtype": "float32"}),
        (["precision=32-true"], {"mixed_precision_param": "float32", "dtype": "float32"}),
        (["precision=bf16-true"], {"dtype": "bfloat16"}),
    ):
        form = exported("torchtitan", *TINY, "policy=full", *ours).forms[0]
        parsed = tyro.cli(Config, args=form.chosen.settings["args"], registry=custom_registry).training
        assert {k: getattr(parsed, k) for k in fields} == fields, (ours, form.chosen.settings["args"])
        assert parsed.mixed_precision_reduce == "float32"
        assert "--training." in form.text
    # The tensor-parallel layout travels as its [parallelism] fields, read by its own parser
    from torchtitan.config.configs import ParallelismConfig

    Config = dataclasses.make_dataclass(
        "Config",
        [
            ("activation_checkpoint", ac.ActivationCheckpointingConfig, field),
            ("training", TrainingConfig, training),
            ("parallelism", ParallelismConfig, dataclasses.field(default_factory=ParallelismConfig)),
        ],
    )
    for sp in (True, False):
        form = exported("torchtitan", *LLAMA, *TP, f"trainer.sequence_parallel={sp}", "policy=full").forms[0]
        parsed = tyro.cli(Config, args=form.chosen.settings["args"], registry=custom_registry).parallelism
        assert (parsed.tensor_parallel_degree, parsed.enable_sequence_parallel) == (2, sp)


def test_torchtitan_per_op_policy_here_decides_as_torchtitan_does() -> None:
    """The registered policy torchtitan_sac (policy.version=0.3) decides every op of a block's forward, and saves
    the same op list, as torchtitan main's own SelectiveAC."""
    ac = pytest.importorskip(
        "torchtitan.distributed.activation_checkpoint", reason="torchtitan is not installed (the `export` extra)"
    )
    from models import build_model
    from trainer.policies import build_policy, library, torchtitan_save_ops

    assert torchtitan_save_ops("0.3") == ac._get_default_save_ops()
    model = build_model(compose_config(LLAMA).model, vocab_size=256)  # bias-free: its linears are aten.mm
    block = model.model.layers[0]
    rope = (model.model.rope_cos[:16], model.model.rope_sin[:16])
    x = torch.randn(2, 16, 64, requires_grad=True)

    def decisions(where: Any, run: Any) -> list[tuple[str, str]]:
        """What each op of the forward was told, through `where`'s create_selective_checkpoint_contexts."""
        seen: list[tuple[str, str]] = []
        real = where.create_selective_checkpoint_contexts

        def spy(policy_fn: Any, *a: Any, **k: Any) -> Any:
            def record(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
                out = policy_fn(ctx, func, *args, **kwargs)
                if not ctx.is_recompute:
                    seen.append((str(func), out.name))
                return out

            return real(record, *a, **k)

        where.create_selective_checkpoint_contexts = spy
        try:
            run()
        finally:
            where.create_selective_checkpoint_contexts = real
        return seen

    wrapped = ac.SelectiveAC(ac.SelectiveAC.Config())._wrap_block(block, base_fqn="layers.0")
    theirs = decisions(ac, lambda: wrapped(x, *rope).sum().backward())
    replica = build_policy({"name": "torchtitan_sac"})
    mine = decisions(library, lambda: replica.run(lambda h: block(h, *rope), x, 0).sum().backward())
    assert mine == theirs
    assert ("aten.mm.default", "MUST_SAVE") in mine and ("aten.mm.default", "PREFER_RECOMPUTE") in mine


# ---- Hugging Face ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy, flags",
    [
        (["policy=full"], [True] * 4),
        (["policy=per_block", "policy.pattern=[full,none]"], [True, False, True, False]),  # every_n_layers=2
        (["policy=op_sac"], [True] * 4),  # context_fn
    ],
)
def test_hf_settings_train_a_tiny_model(
    hf_models: dict[str, Path], tmp_path: Path, policy: list[str], flags: list[bool]
) -> None:
    """The exported kwargs, as TrainingArguments takes them, train a tiny LLaMA with Hugging Face's own Trainer, which
    checkpoints the layers the plan names; the script the export prints builds the same arguments."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the `hf` extra)")
    folder = hf_models["llama"]
    form = exported(
        "hf", "model=hf", f"model.name_or_path={folder}", "model.attention=eager", "seq_len=16", "batch_size=2", *policy
    ).forms[0]
    assert form.verdict == EXACT
    namespace: dict[str, Any] = {}
    exec(form.text, namespace)  # the pasted form
    printed = namespace["training_args"]
    settings = {**form.chosen.settings, **form.loss.settings}
    assert printed.activation_checkpointing is True
    assert printed.activation_checkpointing_kwargs.keys() == settings["activation_checkpointing_kwargs"].keys()
    args = transformers.TrainingArguments(
        **settings,
        output_dir=str(tmp_path),
        max_steps=1,
        use_cpu=True,
        per_device_train_batch_size=2,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    ids = torch.randint(0, 300, (4, 16))
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    loss = trainer.train().training_loss
    assert loss == loss and loss > 0  # finite
    assert [layer.gradient_checkpointing for layer in model.model.layers] == flags


def test_hf_option_the_installed_transformers_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.export.targets import hf

    old = dataclasses.replace(hf.hf_names(), version="4.40.0", every_n_layers=False, offload=False)
    monkeypatch.setattr(hf, "hf_names", lambda: old)
    with pytest.raises(
        ExportRefused,
        match=r"needs activation_checkpointing_kwargs every_n_layers, which "
        r"transformers 4\.40\.0 lacks \(5\.24\.0 has it\)",
    ):
        export(compose_config([*TINY, "policy=per_block", "policy.pattern=[full,none]"]), "hf")


def test_hf_chunked_head_is_liger_approximated_at_our_own_figures() -> None:
    form = exported("hf", *TINY, "policy=full", "loss=chunked").forms[0]
    assert form.verdict == APPROX and form.loss.settings["use_liger_kernel"] is True
    assert form.loss.settings["liger_kernel_config"]["fused_linear_cross_entropy"] is True
    assert (
        form.rows[-1].element == "loss head: chunked (chunk_tokens=4)" and "nothing is recomputed" in form.rows[-1].how
    )
    assert form.notes and form.ours is None  # the same plan and head measured: its figures are ours


# ---- Lightning and torchtune ----------------------------------------------------------------------


def test_lightning_strategy_checkpoints_every_block() -> None:
    """The printed strategy, through Lightning's own setup of its activation-checkpointing kwargs, wraps every block
    of our model in torch's checkpoint_wrapper, and a step runs."""
    from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from models import build_model

    form = exported("lightning", *TINY, "policy=full").forms[0]
    assert form.verdict == EXACT
    assert form.chosen.settings == {"activation_checkpointing_policy": ["models.gpt.GPTBlock"]}
    namespace: dict[str, Any] = {}
    exec(form.text, namespace)
    model = build_model(compose_config(TINY).model, vocab_size=256)
    _setup_activation_checkpointing(model, namespace["strategy"]._activation_checkpointing_kwargs)
    assert all(isinstance(b, CheckpointWrapper) for b in model.transformer.h)
    idx = torch.randint(0, 256, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_torchtune_keys_are_its_recipes_and_its_wrapper_wraps_our_blocks() -> None:
    pytest.importorskip("torchtune", reason="torchtune is not installed (the `export` extra)")
    from omegaconf import OmegaConf
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torchtune import config as tt_config
    from torchtune.models.llama3 import llama3
    from torchtune.training import activations

    answer = exported("torchtune", *LLAMA, *EVERY_SECOND, "loss=chunked")
    form = answer.forms[0]
    assert form.chosen.settings == {"enable_activation_checkpointing": False, "ac_mode": "selective", "ac_option": 2}
    assert form.rows[1].status == EXACT  # llama-tiny has no dropout: preserve_rng_state=False changes nothing
    cfg = OmegaConf.create(form.text)
    recipe = Path(importlib.util.find_spec("torchtune").origin).parents[1] / "recipes" / "full_finetune_distributed.py"
    read = recipe_keys(recipe)
    assert set(cfg) <= read, set(cfg) - read
    assert type(tt_config.instantiate(cfg.loss)).__name__ == "CEWithChunkedOutputLoss"
    model = llama3(
        vocab_size=64, num_layers=6, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=32, intermediate_dim=64
    )
    activations.checkpoint_wrapper.__dict__.pop("_count", None)  # its counter carries over between models
    activations.apply_selective_activation_checkpointing(model, cfg.ac_mode, cfg.ac_option)
    wrapped = [i for i, layer in enumerate(model.layers) if isinstance(layer, CheckpointWrapper)]
    assert wrapped == [i for i, t in enumerate(answer.ctx.plan.treatments) if t == "full"] == [1, 3, 5]


def recipe_keys(path: Path) -> set[str]:
    """The top-level config keys a recipe reads: cfg.get("key", ...), cfg["key"] and cfg.key."""
    keys: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        target = getattr(node, "func", None) if isinstance(node, ast.Call) else None
        if isinstance(target, ast.Attribute) and target.attr == "get" and _cfg(target.value) and node.args:
            keys |= {node.args[0].value} if isinstance(node.args[0], ast.Constant) else set()
        keys |= {node.attr} if isinstance(node, ast.Attribute) and _cfg(node.value) else set()
    return keys


def _cfg(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "cfg"


# ---- The command: auto, refusals, --out and --json ------------------------------------------------


def test_auto_exports_the_plan_the_planner_chose(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """policy=auto: planned as the estimator plans it (stubbed here: the planner has tests of its own), with the
    head it picked, and that plan exported."""
    import trainer.export.cli as cli

    chosen = Plan.per_block(["full", "full", "none", "none", "none", "none"])
    monkeypatch.setattr(cli, "planner_plan", lambda config, device: (chosen, "chunked", "PLANNER TEXT"))
    out = tmp_path / "a.json"
    assert main(["--to", "megatron", *TINY, "policy=auto", "policy.budget_mib=100", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["plan"] == "[0-1]:full [2-5]:none" and data["loss"]["name"] == "chunked"
    assert data["settings"]["recompute_method"] == "block" and data["planner"] == "PLANNER TEXT"
    assert "policy=auto: [0-1]:full [2-5]:none; loss=chunked" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--to", "foo"], "--to foo: choose one of hf, lightning, megatron, torchtitan, torchtune"),
        (["--to", "lightning", "policy=offload"], "FSDPStrategy offloads no activation"),
        (["--to", "torchtitan", "policy=every_k"], "--to megatron can"),
        (["--to", "torchtitan", "--target-version", "9"], "choose one of 0.3, 0.2"),
        (["--to", "megatron", "policy=first_k", "policy.k=9"], "policy.k=9"),
        (["--to", "megatron", "no_such_key=1"], "no_such_key"),
        (["policy=full"], "--to"),  # required
        (["--to", "megatron", "--out", str(ROOT)], "is a folder"),  # these replace the --out / --json given below
        (["--to", "megatron", "--json", f"{__file__}/answer.json"], "cannot write under"),  # under a file
        (["--to", "megatron", "--json", "/proc/answer.json"], "cannot write under /"),  # root too (not os.access)
        (["--to", "megatron", "--out", "same.json", "--json", "same.json"], "both name same.json"),
    ],
)
def test_refusals_are_one_line_exit_2_and_write_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], fragment: str
) -> None:
    """Refused before any work: nothing printed but the line."""
    out, js = tmp_path / "sub" / "settings.txt", tmp_path / "sub" / "answer.json"
    try:
        code = main([*TINY, "--out", str(out), "--json", str(js), *args])
    except SystemExit as e:  # argparse's own refusals exit from inside main
        code = e.code  # type: ignore[assignment]
    assert code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1 and fragment in captured.err, captured
    assert captured.out == "" and not (tmp_path / "sub").exists()


def test_json_and_out_hold_the_answer(tmp_path: Path) -> None:
    out, js = tmp_path / "titan.txt", tmp_path / "titan.json"
    assert main(["--to", "torchtitan", *TINY, "policy=op_sac", "--out", str(out), "--json", str(js)]) == 0
    data = json.loads(js.read_text())
    first = out.read_text().splitlines()[0]
    assert first == data["text"].splitlines()[0] and first.split()[-1] == "activation-checkpoint:selective"
    assert (
        data["target"] == "torchtitan"
        and data["version"] == "0.3"
        and [f["version"] for f in data["forms"]] == ["0.3", "0.2"]
    )
    assert data["names_read_from"].startswith("torchtitan 0.3.0") and data["verdict"] == APPROX
    assert {r["status"] for r in data["fidelity"]} == {APPROX, EXACT}
    ours, closest = data["figures"]["ours"], data["figures"]["closest"]
    assert ours["plan"] == "[0-5]:op_sac" and closest["plan"] == "[0-5]:torchtitan_sac"
    assert all(f[k] > 0 for f in (ours, closest) for k in ("activation_bytes", "peak_bytes", "flops"))


@pytest.mark.slow
def test_cli_megatron_first_k_as_a_user_runs_it(tmp_path: Path) -> None:
    out = tmp_path / "flags.txt"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.export",
            "--to",
            "megatron",
            "policy=first_k",
            "policy.k=2",
            "model=llama-tiny",
            "seq_len=32",
            "batch_size=2",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=CLI_ENV,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "names for megatron-core 0.19.2" in r.stdout and "fidelity: exact" in r.stdout
    assert out.read_text() == "--recompute-granularity full --recompute-method block --recompute-num-layers 2\n"


@pytest.mark.slow
def test_cli_refusal_as_a_user_sees_it(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.export",
            "--to",
            "lightning",
            "policy=op_sac",
            *TINY,
            "--json",
            str(tmp_path / "a.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=CLI_ENV,
    )
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: --to lightning: policy=op_sac ([0-5]:op_sac) cannot be expressed: ")
    assert "--to hf, --to megatron or --to torchtitan can" in r.stderr and not (tmp_path / "a.json").exists()


def test_a_compile_time_policy_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """memory_budget's cut is torch's partitioner's: no plan of ours to map, so the export says so (and names the
    peer) rather than export its blocks as `none`."""
    overrides = ["model=micro", "seq_len=32", "policy=memory_budget", "trainer.compile=true", "model.dropout=0"]
    assert main([*overrides, "--to", "torchtitan"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "memory-budget" in err[0]
