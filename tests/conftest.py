"""Shared fixtures: the real Hydra config, composed and shrunk; no network; a private data cache."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

# Before anything imports `datasets` (it reads these once): tests never touch the network.
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("CKPTLAB_CACHE", tempfile.mkdtemp(prefix="ckptlab-test-cache-"))
# pytest -n auto already runs a worker on every core: inductor's pool of compile processes (one per core by default)
# would only contend with them, so each worker compiles its kernels itself (children inherit it).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from models import FAMILIES  # noqa: E402
from trainer.core.schema import register_configs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
# Every registered native family, from the registry: family-wide tests build each at its test size
# (FamilySpec.tiny_overrides), so a new family is in them without editing them.
NATIVE_FAMILIES = [name for name, spec in FAMILIES.items() if spec.preset is not None]

# Tiny shapes: a training step takes milliseconds; every test run of the trainer uses these.
SMALL = [
    "model=micro",
    "trainer=smoke",
    "seq_len=32",
    "batch_size=4",
    "trainer.enable_progress_bar=false",
    "measure.warmup_steps=1",
    "measure.activation_every_n_steps=2",
    "measure.predict=false",  # each run's own prediction is tests/test_prediction.py's: the suite's time
]

register_configs()
torch.set_num_threads(1)  # see run_cli


@pytest.fixture
def compose_cfg() -> Callable[..., DictConfig]:
    def _compose(*overrides: str, small: bool = True) -> DictConfig:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("config", overrides=[*(SMALL if small else []), *overrides], return_hydra_config=False)

    return _compose


# One thread: tiny shapes gain nothing from a second, and on 2 shared cores its spin-waits cost 10x.
CLI_ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def run_cli(
    *args: str, cwd: Path = ROOT, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run train.py as a user would, in a fresh interpreter (`env`: in place of CLI_ENV)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=CLI_ENV if env is None else env,
    )


# ----------------------------------------------------------------------------------------------------
# Tiny Hugging Face causal LMs, saved as a user's own model folder would be: config.json and a tokenizer.
# ----------------------------------------------------------------------------------------------------

HF_VOCAB = 320  # ≥ the tiny tokenizer's size below


def _tiny_tokenizer() -> object:
    """A byte-level BPE trained on a little real text (the embedded corpus), as a transformers tokenizer."""
    import pydoc_data.topics

    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    text = list(pydoc_data.topics.topics.values())[:20]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(text, vocab_size=300, min_frequency=2, special_tokens=["<|endoftext|>"])
    eot = "<|endoftext|>"
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=eot, bos_token=eot)


def hf_configs() -> dict[str, object]:
    import transformers

    common = {"vocab_size": HF_VOCAB, "bos_token_id": 0, "eos_token_id": 0}
    return {
        "llama": transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            attention_dropout=0.1,
            **common,
        ),
        "gpt2": transformers.GPT2Config(n_embd=32, n_layer=4, n_head=2, n_positions=128, **common),
        "qwen2": transformers.Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            attention_dropout=0.1,
            **common,
        ),
        # a hybrid: Mamba layers (no attention, so no core to recompute) between attention layers
        "jamba": transformers.JambaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=8,
            mamba_d_state=4,
            mamba_dt_rank=4,
            use_mamba_kernels=False,
            attention_dropout=0.1,
            **common,
        ),
        # its layers hand router state to the next layer (`return hidden_states, prev_router_hidden_states`)
        "zaya": transformers.ZayaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=128,
            **common,
        ),
        # its forward scales the logits (`logits * self.logit_scale`) before its loss
        "cohere": transformers.CohereConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            attention_dropout=0.1,
            logit_scale=0.0625,
            **common,
        ),
        # final logit soft-capping, c·tanh(logits / c) (Gemma-2's c is 30; 1 here, so it matters at random weights);
        # no SDPA in transformers
        "gemma2": transformers.Gemma2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=128,
            attention_dropout=0.1,
            sliding_window=16,
            final_logit_softcapping=1.0,
            **common,
        ),
        # its layers live one level down (model.decoder.layers)
        "opt": transformers.OPTConfig(
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            max_position_embeddings=128,
            word_embed_proj_dim=32,
            dropout=0.1,
            attention_dropout=0.1,
            **common,
        ),
        # multi-query attention; inline up to transformers 5.24, a swappable function from 5.25
        "falcon": transformers.FalconConfig(
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            new_decoder_architecture=False,
            multi_query=True,
            attention_dropout=0.1,
            hidden_dropout=0.1,
            **common,
        ),
        # attention computed inline (no swappable function), alternating global and local (sliding-window) layers;
        # layers return (output, attn_weights), the loop reads [0]
        "gpt_neo": transformers.GPTNeoConfig(
            hidden_size=32,
            num_layers=4,
            num_heads=4,
            attention_types=[[["global", "local"], 2]],
            window_size=8,
            max_position_embeddings=128,
            attention_dropout=0.1,
            resid_dropout=0.1,
            embed_dropout=0.1,
            **common,
        ),
        # ALiBi, attention inline, no SDPA in transformers
        "bloom": transformers.BloomConfig(
            hidden_size=32, n_layer=4, n_head=4, attention_dropout=0.1, hidden_dropout=0.1, **common
        ),
    }


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{family: a folder with config.json and a tokenizer (no weights: pretrained=false)} for every family in
    hf_configs()."""
    root = tmp_path_factory.mktemp("hf-models")
    tokenizer = _tiny_tokenizer()
    out = {}
    for name, config in hf_configs().items():
        folder = root / name
        config.save_pretrained(folder)  # type: ignore[attr-defined]
        tokenizer.save_pretrained(folder)  # type: ignore[attr-defined]
        out[name] = folder
    return out
