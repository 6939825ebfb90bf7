"""Decoders behind one contract (models/adapter.py), and `build_model` from a config node.

    family  module          what it is
    gpt     models/gpt.py   GPT-2 style: LayerNorm, learned positions, GELU MLP, biases, tied head
    llama   models/llama.py LLaMA style: RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases
    hf      models/hf.py    any Hugging Face causal LM, from a hub id or a local folder (the `hf` extra)

Each family's module registers it (models/adapter.py: FAMILIES, the only list); importing this package imports
them. Nothing here imports from trainer/ or callbacks/: the config node is read by field name.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from models import gpt, hf, llama  # noqa: F401  (each registers its family)
from models.adapter import FAMILIES


def build_model(cfg: Any, vocab_size: int | None = None, hf_config: Any = None) -> nn.Module:
    """The decoder a config node describes (`cfg.family` picks it), initialised by the caller's torch RNG.

    `vocab_size`: the tokenizer's; a native model takes it (unless cfg.vocab_size is larger), an HF model keeps its
    own (cfg.vocab_size overrides it). `hf_config`: an already loaded HF config, so a folder is read once.
    """
    spec = FAMILIES.get(cfg.family)
    if spec is None:
        raise ValueError(f"model.family={cfg.family!r}; choose one of {', '.join(FAMILIES)}")
    return spec.build(cfg, vocab_size, hf_config)


__all__ = ["FAMILIES", "build_model"]
