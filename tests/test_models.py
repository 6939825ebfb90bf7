"""The model families behind the decoder contract: LLaMA's numerics against the Hugging Face reference, the
contract's view of each family, grouped-query attention inside the seam, and the presets' published shapes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from models import FAMILIES, build_model
from models.adapter import adapter_for
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from tests.conftest import CONF, NATIVE_FAMILIES
from trainer.core.schema import validate
from trainer.measure.memory.tracker import LiveTensorTracker
from trainer.policies import apply_policy


def hf_twin(ours: Llama) -> Any:
    """transformers' LlamaForCausalLM of the same shape, with our weights (parameter names match under prefix)."""
    import transformers

    c = ours.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.n_embd,
        intermediate_size=c.mlp_hidden,
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        num_key_value_heads=c.n_kv_head,
        max_position_embeddings=c.block_size,
        rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
    )
    hf = transformers.LlamaForCausalLM._from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} if c.tie_embeddings else not missing, missing
    return hf.eval()


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_llama_logits_equal_the_hf_reference(attention: str, tie: bool) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        block_size=64,
        n_layer=3,
        n_head=8,
        n_kv_head=2,
        n_embd=64,
        mlp_hidden=160,
        rope_theta=500000.0,
        tie_embeddings=tie,
        attention=attention,
    )
    ours = Llama(config).eval()
    hf = hf_twin(ours)
    idx = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        want = hf(input_ids=idx).logits
        got = ours(idx)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_llama_state_dict_loads_into_hf_and_back() -> None:
    torch.manual_seed(1)
    ours = Llama(LlamaConfig(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_kv_head=1, n_embd=32, mlp_hidden=64))
    hf = hf_twin(ours)
    again = Llama(copy.deepcopy(ours.config))
    again.load_state_dict(hf.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values(), strict=True))


def test_gqa_repeat_is_inside_the_seam_so_selective_drops_it() -> None:
    """With n_kv_head < n_head the eager core repeats k and v per query head; under `selective` those repeated
    copies are recomputed, not kept: the bytes kept after the forward drop by the T×T tensors AND the repeats."""
    torch.manual_seed(0)
    c = LlamaConfig(
        vocab_size=64, block_size=32, n_layer=1, n_head=8, n_kv_head=2, n_embd=64, mlp_hidden=128, attention="eager"
    )
    base = Llama(c)

    def kept(policy: str) -> int:
        model = copy.deepcopy(base)
        apply_policy(model, policy)
        x = torch.randint(0, 64, (2, 32))
        with LiveTensorTracker() as t:
            loss = model(x, x)[1]  # its graph holds what the forward saved
            kept = t.live_bytes
        del loss
        return kept

    B, T, H, KV, D = 2, 32, 8, 2, 8
    # none keeps the softmax output (B·H·T², fp32), the inverted causal mask (T² bools) and k, v repeated to every
    # query head (what the matmuls save); selective keeps only the core's inputs, k and v at their 2 heads.
    kept_by_none = B * H * T * T * 4 + T * T + 2 * B * H * T * D * 4
    kept_by_selective = 2 * B * KV * T * D * 4
    assert kept("none") - kept("selective") == kept_by_none - kept_by_selective


def _torchtitan_variant(rope: str, repeat_kv: bool) -> Llama:
    torch.manual_seed(0)
    c = LlamaConfig(
        vocab_size=64, block_size=32, n_layer=2, n_head=8, n_kv_head=2, n_embd=64, mlp_hidden=128, attention="sdpa"
    )
    c.rope, c.repeat_kv = rope, repeat_kv
    return Llama(c)


def test_repeat_kv_computes_what_shared_heads_compute_and_keeps_the_copies() -> None:
    """model.repeat_kv (torchtitan's model up to 0.2): keys and values copied to every query head before SDPA give
    the same logits as SDPA sharing them, and the kernel keeps the copies: per layer 2·B·(H − Hkv)·T·D values more
    (fp32 here), counted by hand."""
    shared, copied = _torchtitan_variant("half", False), _torchtitan_variant("half", True)
    x = torch.randint(0, 64, (2, 32))
    torch.testing.assert_close(copied(x)[0], shared(x)[0], rtol=1e-5, atol=1e-5)

    def kept(model: Llama) -> int:
        with LiveTensorTracker() as t:
            loss = model(x, x)[1]
            kept = t.live_bytes
        del loss
        return kept

    B, T, H, KV, D, layers = 2, 32, 8, 2, 8, 2
    assert kept(copied) - kept(shared) == layers * 2 * B * (H - KV) * T * D * 4


def test_both_rotary_forms_rotate_by_relative_position() -> None:
    """Each rotary form is a rotation (norms kept) whose query-key products depend on the positions' difference
    only: HF's halves in the residual dtype, torchtitan's complex pairs in fp32 (model.rope=complex)."""
    from models.llama import apply_complex_rotary, apply_rotary, complex_rotary_table, rotary_table

    torch.manual_seed(0)
    c = LlamaConfig(vocab_size=8, block_size=16, n_layer=1, n_head=1, n_embd=8)
    q, k = torch.randn(8), torch.randn(8)
    cos, sin = rotary_table(c)
    freqs = complex_rotary_table(c)

    def half(x: torch.Tensor, pos: int) -> torch.Tensor:
        return apply_rotary(x.view(1, 1, 1, 8), cos[pos : pos + 1], sin[pos : pos + 1]).view(8)

    def pairs(x: torch.Tensor, pos: int) -> torch.Tensor:
        return apply_complex_rotary(x.view(1, 1, 1, 8), freqs[pos : pos + 1]).view(8)

    for rotate in (half, pairs):
        assert torch.allclose(rotate(q, 5).norm(), q.norm(), atol=1e-5)
        assert torch.allclose(rotate(q, 7) @ rotate(k, 3), rotate(q, 12) @ rotate(k, 8), atol=1e-4)
        assert not torch.allclose(rotate(q, 7) @ rotate(k, 3), rotate(q, 7) @ rotate(k, 4), atol=1e-4)
    complex_model = _torchtitan_variant("complex", True)
    assert complex_model.model.freqs_cis.dtype == torch.complex64 and "freqs_cis" not in complex_model.state_dict()
    x = torch.randint(0, 64, (2, 32))
    loss = complex_model(x, x)[1]
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in complex_model.parameters())


@pytest.mark.parametrize(
    "preset, layers, d, heads, kv, hidden, vocab, params",
    [
        ("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 6_738_415_616),
        ("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8_030_261_248),
        ("llama3-1b", 16, 2048, 32, 8, 8192, 128256, 1_235_814_400),
    ],
)
def test_presets_have_the_published_shapes(
    compose_cfg: Any, preset: str, layers: int, d: int, heads: int, kv: int, hidden: int, vocab: int, params: int
) -> None:
    """Shapes from each model's config.json; parameter counts as the model cards publish them, counted on a
    meta-device model (nothing allocated)."""
    m = validate(compose_cfg(f"model={preset}", small=False)).model
    assert (m.n_layer, m.n_embd, m.n_head, m.n_kv_head, m.mlp_hidden, m.vocab_size) == (
        layers,
        d,
        heads,
        kv,
        hidden,
        vocab,
    )
    with torch.device("meta"):
        model = build_model(m)
    assert adapter_for(model).num_parameters() == params


def test_every_model_yaml_builds_through_the_contract(compose_cfg: Any, hf_models: dict[str, Path]) -> None:
    for path in sorted((CONF / "model").glob("*.yaml")):
        extra = [f"model.name_or_path={hf_models['llama']}"] if path.stem == "hf" else []
        m = validate(compose_cfg(f"model={path.stem}", *extra, "seq_len=16", small=False)).model
        with torch.device("meta"):
            model = build_model(m, 256)
        a = adapter_for(model)
        d = a.describe()
        assert a.n_layer == len(a.layers) > 0 and d["family"] in FAMILIES, path.stem
        assert a.head.weight.shape[-1] == d["n_embd"] and a.attention in ("eager", "sdpa")


@pytest.mark.parametrize("family", NATIVE_FAMILIES)
def test_every_native_family_has_a_test_size_that_trains(compose_cfg: Any, family: str) -> None:
    """What the family-wide tests iterate: the registry's test size of each native family is a conf/model preset of
    that family, shrunk, and it builds and takes a backward through the contract."""
    from trainer.core import build

    spec = FAMILIES[family]
    assert validate(compose_cfg(f"model={spec.preset}")).model.family == family
    config = validate(compose_cfg(*spec.tiny_overrides, "policy=full"))
    module = build.module(config, "full")
    assert module.adapter.family == family
    idx = torch.randint(0, 256, (2, 16))
    module.loss_of((idx, idx)).backward()
    assert all(p.grad is not None for p in module.parameters())


def test_gpt_tied_and_untied_heads() -> None:
    tied = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    untied = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, tie_embeddings=False))
    assert adapter_for(tied).tied_head and not adapter_for(untied).tied_head
    assert untied.num_parameters() - tied.num_parameters() == 64 * 32


def test_the_contract_refuses_a_model_that_is_not_a_decoder() -> None:
    with pytest.raises(TypeError, match="decoder contract"):
        adapter_for(torch.nn.Linear(2, 2))


def test_a_new_native_family_is_one_module_that_registers(compose_cfg: Any) -> None:
    """What the README's extending table says: a family registers itself (here a GPT under another name), and the
    config, the builder, the contract and a training step take it with no other change."""
    from models.adapter import FAMILIES
    from models.gpt import GPT, GPTConfig
    from models.native import register_native
    from trainer.core import build
    from trainer.core.schema import validate

    class Toy(GPT):
        pass

    register_native("toy", Toy, GPTConfig, preset="micro", tiny={})
    try:
        config = validate(compose_cfg("model=micro", "model.family=toy", "policy=full"))
        module = build.module(config, "full")
        assert type(module.model) is Toy and module.adapter.family == "toy"
        assert module.model.activation_plan.describe().endswith(":full")
        idx = torch.randint(0, 256, (2, 16))
        module.loss_of((idx, idx)).backward()
        assert all(p.grad is not None for p in module.parameters())
    finally:
        FAMILIES.pop("toy")
