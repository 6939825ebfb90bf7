"""Decoders behind one contract (models/adapter.py), and `build_model` from a config node.

    family  module          what it is
    gpt     models/gpt.py   GPT-2 style: LayerNorm, learned positions, GELU MLP, biases, tied head
    llama   models/llama.py LLaMA style: RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases
    hf      models/hf.py    any Hugging Face causal LM, from a hub id or a local folder (the `hf` extra)

Nothing here imports from trainer/ or callbacks/: the config node is read by field name.
"""

from __future__ import annotations

import copy
from dataclasses import fields
from typing import Any

from torch import nn

from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig

FAMILIES = ("gpt", "llama", "hf")
NATIVE = {"gpt": (GPT, GPTConfig), "llama": (Llama, LlamaConfig)}


def native_config(cfg: Any, vocab_size: int | None = None) -> GPTConfig | LlamaConfig:
    """The family's typed config from a config node's fields of the same names (runs its range checks)."""
    _, config_cls = NATIVE[cfg.family]
    values = {f.name: getattr(cfg, f.name) for f in fields(config_cls) if getattr(cfg, f.name, None) is not None}
    values["vocab_size"] = vocab_size or getattr(cfg, "vocab_size", None) or 256
    return config_cls(**values)


def build_model(cfg: Any, vocab_size: int | None = None, hf_config: Any = None) -> nn.Module:
    """The decoder a config node describes (`cfg.family` picks it), initialised by the caller's torch RNG.

    `vocab_size`: the tokenizer's; a native model takes it (unless cfg.vocab_size is larger), an HF model keeps its
    own (cfg.vocab_size overrides it). `hf_config`: an already loaded HF config, so a folder is read once.
    """
    if cfg.family in NATIVE:
        model_cls, _ = NATIVE[cfg.family]
        return model_cls(native_config(cfg, max(vocab_size or 0, cfg.vocab_size or 0) or None))
    if cfg.family == "hf":
        from models.hf import load_causal_lm, load_config

        config = copy.deepcopy(hf_config) if hf_config is not None else load_config(str(cfg.name_or_path))
        if cfg.vocab_size is not None:  # on a copy: the caller's loaded config stays as it was read
            config.vocab_size = cfg.vocab_size
        return load_causal_lm(str(cfg.name_or_path), cfg.pretrained, cfg.attention, cfg.dropout, config=config)
    raise ValueError(f"model.family={cfg.family!r}; choose one of {', '.join(FAMILIES)}")
