"""Hugging Face causal LMs behind the contract: a user's local folder trains under the project's policies with its own
tokenizer, pretrained weights load, and every way it can go wrong is one line. No network: tiny configs and a
tiny tokenizer are written to a temp folder (tests/conftest.py)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from models.adapter import adapter_for
from models.hf import HFModelError, load_causal_lm
from tests.conftest import SMALL, run_cli
from trainer.core.run import train

RUN = ["trainer.max_steps=3", "trainer.enable_checkpointing=false", "trainer.val_batches=1", "seq_len=32"]


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_a_local_folder_trains_with_its_own_tokenizer(
    compose_cfg: Callable[..., Any], hf_models: dict[str, Path], tmp_path: Path, family: str
) -> None:
    cfg = compose_cfg(
        "model=hf",
        f"model.name_or_path={hf_models[family]}",
        "model.attention=eager",
        "data.tokenizer=model",
        "policy=op_sac",
        *RUN,
    )
    summary = train(cfg, tmp_path / "run")
    assert summary["status"] == "completed" and summary["plan"] == "[0-3]:op_sac"
    assert summary["data"]["tokenizer"] == "model"
    model = summary["model"]
    assert model["family"] == "hf" and model["n_layer"] == 4 and model["vocab_size"] == 320
    assert summary["activation_peak_mib"] > 0 and summary["final_train_loss"] < 6.0  # ln(320) ≈ 5.77


def test_pretrained_loads_the_saved_weights(hf_models: dict[str, Path], tmp_path: Path) -> None:
    import transformers

    folder = tmp_path / "trained"
    shutil.copytree(hf_models["llama"], folder)
    torch.manual_seed(3)
    saved = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    saved.save_pretrained(folder)
    loaded = load_causal_lm(str(folder), pretrained=True)
    fresh = load_causal_lm(str(folder), pretrained=False)
    want = saved.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())
    assert not all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())


def test_dropout_override_sets_every_probability(hf_models: dict[str, Path]) -> None:
    gpt2 = load_causal_lm(str(hf_models["gpt2"]), dropout=0.0)
    assert (gpt2.config.attn_pdrop, gpt2.config.resid_pdrop, gpt2.config.embd_pdrop) == (0.0, 0.0, 0.0)
    llama = load_causal_lm(str(hf_models["llama"]))  # null: the config's own
    assert llama.config.attention_dropout == 0.1
    import transformers

    mine = transformers.AutoConfig.from_pretrained(hf_models["llama"])
    mine.attention_dropout = 0  # an int zero counts too
    assert load_causal_lm("", config=mine, dropout=0.2).config.attention_dropout == 0.2
    assert mine.attention_dropout == 0  # the caller's config is not changed


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_the_seamed_eager_core_computes_what_hf_does(hf_models: dict[str, Path], family: str) -> None:
    """The seam's attention is HF's own: causal (a later token changes no earlier logit) and equal to HF's eager
    and SDPA implementations on the same weights."""
    import transformers

    ours = load_causal_lm(str(hf_models[family]), attention="eager", dropout=0.0).eval()
    idx = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    later = idx.clone()
    later[:, -1] = (later[:, -1] + 1) % 320
    with torch.no_grad():
        logits = ours(input_ids=idx).logits
        assert torch.equal(ours(input_ids=later).logits[:, :-1], logits[:, :-1])
        for impl in ("eager", "sdpa"):
            hf = transformers.AutoModelForCausalLM.from_config(ours.config, attn_implementation=impl).eval()
            hf.load_state_dict(ours.state_dict())
            torch.testing.assert_close(hf(input_ids=idx).logits, logits, rtol=1e-5, atol=1e-5)


def test_a_model_built_with_hfs_own_eager_gets_the_seam_and_the_same_logits(hf_models: dict[str, Path]) -> None:
    """An HF model made outside load_causal_lm with attn_implementation="eager" has T×T scores: the adapter says
    eager and moves it onto the seam (HF's eager function), so selective recomputes them; the logits are unchanged."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(hf_models["llama"])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    idx = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=idx).logits
        adapter = adapter_for(model)
        assert adapter.attention == "eager" and adapter.describe()["attn_implementation"] == "ckptlab_eager"
        assert torch.equal(model(input_ids=idx).logits, before)


def test_a_model_sharded_by_fsdp2_keeps_its_attention_seam() -> None:
    """FSDP2 swaps a sharded model's class for a generated FSDP<name> subclass defined in torch; the seam is looked up
    on the model's own class, so `selective` is estimated on an FSDP2 rank (a run's prediction) as it runs."""
    import transformers
    from torch.distributed.fsdp import FSDPModule

    from models.hf import has_attention_seam

    sharded = type("FSDPLlamaForCausalLM", (FSDPModule, transformers.LlamaForCausalLM), {})
    assert has_attention_seam(sharded) and has_attention_seam(transformers.LlamaForCausalLM)
    bloom = type("FSDPBloomForCausalLM", (FSDPModule, transformers.BloomForCausalLM), {})
    assert not has_attention_seam(bloom)  # inline attention stays seamless, sharded or not


def test_eager_attention_runs_the_seam_and_sdpa_does_not(hf_models: dict[str, Path]) -> None:
    from models.hf import WRAPPER_ATTR

    eager, sdpa = (load_causal_lm(str(hf_models["llama"]), attention=a) for a in ("eager", "sdpa"))
    assert adapter_for(eager).attention == "eager" and adapter_for(sdpa).attention == "sdpa"
    calls = []

    def wrapper(fn: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(fn.__module__)
        return fn(*args, **kwargs)

    for model in (eager, sdpa):
        adapter_for(model).wrap_core_attention(0, wrapper)
        model(input_ids=torch.randint(0, 320, (1, 8)))
    assert calls == ["transformers.models.llama.modeling_llama"]  # the model's own eager core, once (eager model)
    assert WRAPPER_ATTR in adapter_for(sdpa).attention_module(0).__dict__


# ----------------------------------------------------------------------------------------------------
# One line for each way it goes wrong.
# ----------------------------------------------------------------------------------------------------


def test_a_folder_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(HFModelError, match="the folder has no config.json; point it at a saved Hugging Face model"):
        load_causal_lm(str(tmp_path))


def test_a_hub_id_offline_fails_at_once() -> None:
    with pytest.raises(HFModelError) as e:
        load_causal_lm("surely-not/a-cached-model")
    assert "offline and no cached copy (offline mode is on (HF_HUB_OFFLINE))" in str(e.value)
    assert "\n" not in str(e.value)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_hub_is_probed_once_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hub_constants

    from models import hub

    port = _closed_port()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "offline_requested", lambda: False)
    monkeypatch.setattr(hub_constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(hub, "_probed", {})
    probes: list[tuple[str, int]] = []
    connects = hub._connects
    monkeypatch.setattr(hub, "_connects", lambda h, p, t: probes.append((h, p)) or connects(h, p, t))
    for _ in range(2):
        with pytest.raises(HFModelError, match=rf"no cached copy \(hub 127.0.0.1:{port} is unreachable\)"):
            load_causal_lm("surely-not/a-cached-model")
    assert probes == [("127.0.0.1", port)]  # config, then again: one probe


def test_the_probe_goes_where_the_proxy_settings_send_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hub_constants

    from models import hub

    port = _closed_port()
    monkeypatch.setattr(hub_constants, "ENDPOINT", "https://huggingface.co")
    monkeypatch.setattr(hub, "_probed", {})
    for name in ("HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{port}")
    assert hub.reachable() == (False, f"huggingface.co:443 via proxy 127.0.0.1:{port}")
    monkeypatch.setenv("NO_PROXY", "huggingface.co")
    probes: list[tuple[str, int]] = []
    monkeypatch.setattr(hub, "_connects", lambda h, p, t: probes.append((h, p)) or False)
    assert hub.reachable() == (False, "huggingface.co:443") and probes == [("huggingface.co", 443)]


def test_a_model_that_is_not_a_causal_lm(tmp_path: Path) -> None:
    import transformers

    transformers.T5Config(vocab_size=64, d_model=16, num_layers=1, num_heads=2, d_ff=32).save_pretrained(tmp_path)
    with pytest.raises(HFModelError, match="is a T5Config .t5., not a causal language model"):
        load_causal_lm(str(tmp_path))


def test_data_tokenizer_model_without_a_tokenizer(
    compose_cfg: Callable[..., Any], hf_models: dict[str, Path], tmp_path: Path
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(hf_models["llama"] / "config.json", bare / "config.json")
    cfg = compose_cfg("model=hf", f"model.name_or_path={bare}", "data.tokenizer=model", *RUN)
    with pytest.raises(HFModelError) as e:
        train(cfg, tmp_path / "run")
    assert str(e.value).startswith(f"data.tokenizer=model: {bare} has no tokenizer that loads")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("family", ["gpt_neo", "bloom"])
def test_a_family_without_a_swappable_attention_runs_transformers_own_eager(
    hf_models: dict[str, Path], family: str
) -> None:
    """GPT-Neo and Bloom compute attention inline: model.attention=eager loads transformers' own eager
    implementation (Bloom has no SDPA at all), the logits are the model's own, and only selective, which needs the
    seam, is refused in one line; every other policy installs."""
    import transformers

    from trainer.policies import PolicyError, apply_policy

    torch.manual_seed(0)
    model = load_causal_lm(str(hf_models[family]), attention="eager", dropout=0.0).eval()
    adapter = adapter_for(model)
    assert model.config._attn_implementation == "eager" and adapter.attention == "eager"
    assert not adapter.has_attention_seam
    hf = transformers.AutoModelForCausalLM.from_config(model.config, attn_implementation="eager").eval()
    hf.load_state_dict(model.state_dict())
    idx = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(adapter.logits(adapter.hidden(idx)), hf(input_ids=idx).logits)
    with pytest.raises(PolicyError, match="has no swappable attention function .* choose op_sac or full") as e:
        apply_policy(model, "selective")
    assert "\n" not in str(e.value)
    for policy in ("full", "op_sac", "sqrt", "first_k"):
        apply_policy(model, policy)


def test_sdpa_on_a_family_transformers_has_no_sdpa_for_is_one_line_and_leaves_no_folder(
    compose_cfg: Callable[..., Any], hf_models: dict[str, Path], tmp_path: Path
) -> None:
    for family in ("gemma2", "bloom"):
        cfg = compose_cfg("model=hf", f"model.name_or_path={hf_models[family]}", "model.attention=sdpa", *RUN)
        with pytest.raises(HFModelError, match=r"has no SDPA attention in transformers .*; use model.attention=eager"):
            train(cfg, tmp_path / "run")
        assert not (tmp_path / "run").exists()


def test_unnamed_attention_is_the_best_the_family_has_and_the_run_says_which(
    compose_cfg: Callable[..., Any], hf_models: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """model.attention left null (conf/model/hf.yaml) picks as transformers does: SDPA where the family has it
    (llama), its eager attention where it has none (gemma2 through the seam, bloom inline), and the run's log says
    which before the first step; a named model.attention stays strict (the test above)."""
    from trainer.core.schema import validate

    expected = {"llama": ("sdpa", "sdpa"), "gemma2": ("eager", "ckptlab_eager"), "bloom": ("eager", "eager")}
    for family, (attention, impl) in expected.items():
        cfg = compose_cfg("model=hf", f"model.name_or_path={hf_models[family]}", "policy=full", *RUN)
        assert cfg.model.attention is None
        assert validate(cfg).model.attention == attention
        caplog.clear()
        with caplog.at_level("INFO"):
            summary = train(cfg, tmp_path / family)
        assert summary["status"] == "completed"
        assert summary["model"]["attention"] == attention and summary["model"]["attn_implementation"] == impl
        lines = [r.getMessage() for r in caplog.records]
        chosen = next(i for i, line in enumerate(lines) if line.startswith("model.attention=null: "))
        started = next(i for i, line in enumerate(lines) if f"attention={attention} policy=full" in line)
        assert chosen < started
        assert ("no SDPA attention" in lines[chosen]) == (attention == "eager")


def test_selective_on_a_family_computing_attention_inline_leaves_no_folder(
    compose_cfg: Callable[..., Any], hf_models: dict[str, Path], tmp_path: Path
) -> None:
    from trainer.policies import PolicyError

    cfg = compose_cfg(
        "model=hf", f"model.name_or_path={hf_models['gpt_neo']}", "model.attention=eager", "policy=selective", *RUN
    )
    with pytest.raises(PolicyError, match="GPTNeoForCausalLM has no swappable attention function"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_layers_are_found_where_the_family_keeps_them(hf_models: dict[str, Path]) -> None:
    """OPT keeps its decoder layers one level down (model.decoder.layers): found by its _no_split_modules class,
    and the hidden states are the decoder's own output (its causal LM calls model.decoder, not model)."""
    model = load_causal_lm(str(hf_models["opt"]), dropout=0.0).eval()
    adapter = adapter_for(model)
    assert adapter.layers is model.model.decoder.layers and adapter.n_layer == 4
    idx = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(adapter.logits(adapter.hidden(idx)), model(input_ids=idx).logits)


def test_a_model_without_a_layer_list_is_one_line() -> None:
    import transformers

    from models.hf import HFAdapter

    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=320
        )
    )
    model._no_split_modules = ["NotItsLayer"]
    model.model.extra = torch.nn.ModuleList([torch.nn.Linear(2, 2)])  # two candidate lists, neither named
    with pytest.raises(HFModelError, match=r"no ModuleList of its decoder-layer class \(\['NotItsLayer'\]") as e:
        HFAdapter(model)
    assert "\n" not in str(e.value)


# Families whose forward does something to its logits (Cohere scales them, Gemma-2 soft-caps them) and families
# that do nothing: the project's loss, through every head, is the one the model's own forward computes with labels.
OWN_LOSS_FAMILIES = ["llama", "gpt2", "qwen2", "cohere", "gemma2", "opt", "falcon", "gpt_neo", "bloom"]
TRANSFORMS = {"cohere": "× 0.0625", "gemma2": "1·tanh(·/1)"}


@pytest.mark.parametrize("head", ["standard", "chunked", "fused"])
@pytest.mark.parametrize("family", OWN_LOSS_FAMILIES)
def test_the_training_loss_and_its_gradients_are_the_models_own(
    hf_models: dict[str, Path], family: str, head: str
) -> None:
    from trainer.core.module import DecoderModule
    from trainer.core.schema import ConfigError
    from trainer.loss import head_loss

    model_cfg = {"family": "hf", "name_or_path": str(hf_models[family]), "attention": "eager", "dropout": 0.0}
    torch.manual_seed(0)
    if family == "gemma2" and head == "fused":  # a soft-cap cannot enter torch's fused op: refused at build
        with pytest.raises(
            ConfigError,
            match=r"loss=fused cannot apply Gemma2ForCausalLM's logit transform "
            r"\(1·tanh\(·/1\)\).*use loss=chunked",
        ):
            DecoderModule(model_cfg, loss={"name": head})
        return
    module = DecoderModule(model_cfg, loss={"name": head, "chunk_tokens": 8})  # 3 chunks of the 2 × 12 tokens
    adapter = module.adapter
    assert adapter.describe()["logit_transform"] == TRANSFORMS.get(family, "none")
    idx = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    targets = torch.cat([idx[:, 1:], torch.full((2, 1), -100)], dim=1)  # what labels=idx means to HF: shifted

    def loss_and_grads(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        module.zero_grad(set_to_none=True)
        loss = fn()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}

    own, own_grads = loss_and_grads(lambda: module.model(input_ids=idx, labels=idx).loss)
    ours, grads = loss_and_grads(lambda: module.loss_of((idx, targets)))
    torch.testing.assert_close(ours, own, rtol=1e-6, atol=0)
    assert grads.keys() == own_grads.keys()
    for name, grad in grads.items():  # fp32, the same sums in another order: within 1e-5 of each largest element
        scale = own_grads[name].abs().max().item()  # (+1e-9: a key bias's gradient is zero but for rounding)
        off = (grad - own_grads[name]).abs().max().item()
        assert off <= 1e-5 * scale + 1e-9, f"{family} {head}: {name} off by {off:.3g} (largest {scale:.3g})"
    if family in TRANSFORMS:  # the comparison can fail: without the transform the loss is another one
        with torch.no_grad():
            plain = head_loss(adapter.hidden(idx), adapter.head, targets, module.loss_config)
        assert abs(plain.item() - own.item()) > 1e-4


def test_a_head_the_loss_cannot_follow_is_refused_in_one_line(hf_models: dict[str, Path]) -> None:
    """A transform this project does not know (here an in-place change of the logits) is refused at load, naming
    the statement, rather than trained as another objective."""
    import transformers

    from models import hf_source

    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(hf_models["llama"]))

    class Masked(type(model)):  # type: ignore[misc]
        def forward(self, input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
            hidden_states = self.model(input_ids=input_ids).last_hidden_state
            logits = self.lm_head(hidden_states)
            logits[..., 0] = -1e4
            loss = self.loss_function(logits, labels, self.vocab_size)
            return loss

    model.__class__ = Masked
    reason = hf_source.head_transform(model)
    assert isinstance(reason, str) and "cannot follow (logits[..., 0] = -10000.0)" in reason
    model.config.output_router_logits = False
    reason = hf_source.head_transform(
        transformers.AutoModelForCausalLM.from_config(
            transformers.MixtralConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_local_experts=2,
                vocab_size=320,
                output_router_logits=True,
            )
        )
    )
    assert isinstance(reason, str) and "adds to its loss" in reason and "aux_loss" in reason


def test_a_tokenizer_larger_than_the_vocabulary(
    compose_cfg: Callable[..., Any], hf_models: dict[str, Path], tmp_path: Path
) -> None:
    from trainer.core.schema import ConfigError

    cfg = compose_cfg(
        "model=hf", f"model.name_or_path={hf_models['gpt2']}", "data.tokenizer=bpe", "data.bpe_vocab_size=400", *RUN
    )
    with pytest.raises(ConfigError, match="the tokenizer's 400 ids do not fit hf's vocabulary of 320"):
        train(cfg, tmp_path / "run")


@pytest.mark.slow
def test_cli_trains_a_local_hf_model_as_the_readme_says(hf_models: dict[str, Path], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    r = run_cli(
        *SMALL,
        "model=hf",
        f"model.name_or_path={hf_models['qwen2']}",
        "policy=op_sac",
        "data.tokenizer=model",
        f"hydra.run.dir={run_dir}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["model"]["model_type"] == "qwen2"


@pytest.mark.slow
def test_cli_hf_errors_are_one_line(hf_models: dict[str, Path], tmp_path: Path) -> None:
    for args, fragment in (
        (["model=hf", f"model.name_or_path={tmp_path}"], "has no config.json"),
        (["model=hf", "model.name_or_path=surely-not/a-cached-model"], "offline and no cached copy"),
        (["model=hf"], "model.name_or_path"),
        (["model=hf", f"model.name_or_path={hf_models['gemma2']}", "model.attention=sdpa"], "no SDPA attention"),
        (
            ["model=hf", f"model.name_or_path={hf_models['gpt_neo']}", "model.attention=eager", "policy=selective"],
            "has no swappable attention function",
        ),
    ):
        r = run_cli(*SMALL, *args, f"hydra.run.dir={tmp_path / 'run'}")
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and fragment in lines[0], r.stderr[-2000:]
        assert not (tmp_path / "run").exists()  # a refused run leaves no half-written folder


def test_a_loop_that_calls_its_layers_again_refuses_grouping() -> None:
    """A recurrent section (Dory runs some layers several times per forward) cannot be one group: the group runs
    each layer once, in order. Read from the loop's source: nested in another loop."""
    from torch import nn

    from models import hf_source

    class Looped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            for _ in range(2):
                for layer in self.layers:
                    hidden_states = layer(hidden_states)
            return hidden_states

    class Once(Looped):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                hidden_states = layer(hidden_states)
            return hidden_states

    looped = hf_source.layer_output(Looped(), "layers")
    assert looped is not None and looped.kind == "repeats" and not looped.groupable
    assert "more than once" in looped.why_not_groupable
    once = hf_source.layer_output(Once(), "layers")
    assert once is not None and once.kind == "tensor" and once.groupable


def test_a_scaled_head_input_is_the_models_own_scale(hf_models: dict[str, Path]) -> None:
    """MiniCPM3 divides the hidden states before its head (`hidden_states / logits_scaling`): read as a scale of
    the logits, since the head has no bias; a head fed by another module (ModernBERT's prediction head) is refused."""
    import transformers

    from models import hf_source

    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(hf_models["llama"]))

    class Scaled(type(model)):  # type: ignore[misc]
        def forward(self, input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
            hidden_states = self.model(input_ids=input_ids).last_hidden_state
            hidden_states = hidden_states / self.config.logits_scaling
            logits = self.lm_head(hidden_states)
            loss = self.loss_function(logits, labels, self.vocab_size)
            return loss

    class Fed(type(model)):  # type: ignore[misc]
        def forward(self, input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
            hidden_states = self.model(input_ids=input_ids).last_hidden_state
            logits = self.lm_head(self.model.norm(hidden_states))
            loss = self.loss_function(logits, labels, self.vocab_size)
            return loss

    model.config.logits_scaling = 4.0
    model.__class__ = Scaled
    found = hf_source.head_transform(model)
    assert not isinstance(found, str) and found.scale == 0.25 and found.shifts_labels
    model.__class__ = Fed
    found = hf_source.head_transform(model)
    assert isinstance(found, str) and "self.model.norm(hidden_states)" in found


def test_the_source_reader_short_circuits_and_refuses_what_it_cannot_compare() -> None:
    """`self.config.cap is not None and self.config.cap > 0` with cap=None raised TypeError at model load (both sides
    were evaluated): `and`/`or` now stop as Python does, and a comparison a value cannot take is not known (the
    caller's one-line refusal), never a traceback."""
    import ast
    import types

    from models.hf_source import _Evaluator, _Unknown

    model = torch.nn.Module()
    model.config = types.SimpleNamespace(cap=None, scale=2.0)  # type: ignore[assignment]
    ev = _Evaluator(model)

    def evaluate(src: str) -> object:
        return ev(ast.parse(src, mode="eval").body)

    assert evaluate("self.config.cap is not None and self.config.cap > 0") is False
    assert evaluate("self.config.cap is None or self.config.cap > 0") is True
    assert evaluate("self.config.scale and self.config.scale > 1") is True
    with pytest.raises(_Unknown):
        evaluate("self.config.cap > 0")
