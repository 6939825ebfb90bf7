"""This project's own decoders behind the contract: one adapter for every native family, and the registration a
native family makes in its own module (`register_native("gpt", GPT, GPTConfig, preset=…, tiny=…)` at the end of
models/gpt.py).

A native model has `layers` (nn.ModuleList), `hidden_states(idx)` (its forward with `hidden_only=True`), `lm_head`,
`config` (with n_layer, n_embd, n_head, vocab_size, block_size, attention, dropout) and a `core_attention` method on
each layer's `attn`; its config class is a dataclass whose fields a config node names the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import torch
from torch import nn

from models.adapter import DecoderAdapter, FamilySpec, Wrapper, register_family


class NativeAdapter(DecoderAdapter):
    """This project's decoders: `model.layers`, `model.hidden_states`, `model.lm_head`, `layer.attn.core_attention`."""

    def __init__(self, model: nn.Module, family: str) -> None:
        super().__init__(model)
        self.family = family

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx, hidden_only=True)

    @property
    def head(self) -> nn.Linear:
        return self.model.lm_head

    @property
    def attention(self) -> str:
        return self.model.config.attention

    def attention_module(self, i: int) -> nn.Module | None:
        return self.layers[i].attn

    def wrap_core_attention(self, i: int, wrapper: Wrapper | None) -> None:
        attn = self.layers[i].attn
        if wrapper is None:
            attn.__dict__.pop("core_attention", None)
            return
        core = type(attn).core_attention.__get__(attn)  # the class's method: a wrapper never wraps itself
        attn.core_attention = functools.partial(wrapper, core)

    def tensor_parallel_plan(self, sequence_parallel: bool) -> dict[str, Any] | None:
        plan = getattr(self.model, "tensor_parallel_plan", None)
        return plan(sequence_parallel) if plan is not None else None

    def tensor_parallel_divisors(self) -> dict[str, int]:
        c = self.model.config
        return {
            "model.n_head": c.n_head,
            "model.n_kv_head": getattr(c, "n_kv_head", None) or c.n_head,
            "vocab_size": self.head.weight.shape[0],
        }

    def describe(self) -> dict[str, Any]:
        c = self.model.config
        return {
            "family": self.family,
            "n_layer": c.n_layer,
            "n_embd": c.n_embd,
            "n_head": c.n_head,
            "n_kv_head": getattr(c, "n_kv_head", None) or c.n_head,
            "vocab_size": c.vocab_size,
            "block_size": c.block_size,
            "attention": c.attention,
            "dropout": c.dropout,
            "tied_head": self.tied_head,
            "params": self.num_parameters(),
        }


def native_config(cfg: Any, config_cls: type, vocab_size: int | None = None) -> Any:
    """The family's typed config from a config node's fields of the same names (runs its range checks)."""
    values = {f.name: getattr(cfg, f.name) for f in fields(config_cls) if getattr(cfg, f.name, None) is not None}
    values["vocab_size"] = vocab_size or getattr(cfg, "vocab_size", None) or 256
    return config_cls(**values)


def _check(name: str, config_cls: type, cfg: Any) -> None:
    if cfg.dropout is None:
        raise ValueError(f"model.dropout=null is for model=hf; give the {name} model a number")
    native_config(cfg, config_cls)  # the config class's own range checks (n_head ÷ n_kv_head, ...)


def register_native(
    name: str, model_cls: type[nn.Module], config_cls: type, preset: str, tiny: Mapping[str, Any]
) -> FamilySpec:
    """Register a native family: its models are `model_cls`, built from `config_cls` with the tokenizer's vocabulary
    (unless the config node's vocab_size is larger); `preset` and `tiny`, its test size (FamilySpec)."""

    def build(cfg: Any, vocab_size: int | None, hf_config: Any = None) -> nn.Module:
        return model_cls(native_config(cfg, config_cls, max(vocab_size or 0, cfg.vocab_size or 0) or None))

    return register_family(
        FamilySpec(
            name,
            owns=lambda m: isinstance(m, model_cls),
            adapter=functools.partial(NativeAdapter, family=name),
            build=build,
            check=functools.partial(_check, name, config_cls),
            preset=preset,
            tiny=dict(tiny),
        )
    )
