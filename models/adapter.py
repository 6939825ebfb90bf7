"""The decoder contract: the one view of a model that policies, the planner, the estimator, FSDP2 and the
LightningModule use. Nothing outside models/ names a model class or reaches into one.

    adapter = adapter_for(model)
    adapter.layers                 the decoder layers, in order (nn.ModuleList). Each is called by the model as
                                   layer(hidden, *context, **context) -> hidden: GPT passes nothing else, LLaMA
                                   the rotary cos/sin, a Hugging Face model its mask, positions and rotary table.
                                   A policy may replace a layer's forward (`override_forward`); the model's own
                                   loop still calls every layer in order, with the context it always passes.
    adapter.hidden(idx)            (B, T) token ids -> (B, T, C) final-norm hidden states, by calling the model
                                   (so hooks on it, FSDP2's all-gather among them, run as for any forward)
    adapter.head                   the output projection (weight (V, C), bias or None): the loss reads it
    adapter.attention              "eager" | "sdpa": is there a T×T score tensor for `selective` to drop?
    adapter.wrap_core_attention(i, wrapper)
                                   the attention seam: layer i's core attention (GQA key/value repeat, QKᵀ,
                                   softmax, dropout, ·V) runs as wrapper(core, *args, **kwargs); None restores it.
                                   A layer without attention (a hybrid model's state-space layer) has no seam.
    adapter.logit_transform        what the model's own forward does to head(hidden) before its loss (Cohere's
                                   logit scale, Gemma-2's final soft-capping): every loss head applies it
    adapter.has_attention_seam     can the core attention be wrapped at all (False where the family computes
                                   attention inline, not through a swappable function): `selective` needs it
    adapter.layer_output           what the model's loop takes from a layer's return and hands to the next
                                   (the tensor itself, or its first element); `passes_more` (router state for the
                                   next layer) means blocks cannot be grouped: every_k and sqrt refuse
    adapter.describe()             family and shape, for summaries and the estimator's header
    adapter.tensor_parallel_plan(sequence_parallel)
                                   torch ParallelStyles by module path (trainer/parallel/tensor.py applies them),
                                   or None where the family has none; `tensor_parallel_divisors()` what t divides

Each family registers a FamilySpec (its adapter and builder) from its own module, and this module imports none:
this project's own decoders share models/native.py's adapter (`layers`, `hidden_states`, `lm_head`, and a
`core_attention` method on each layer's `attn`); Hugging Face causal LMs (models/hf.py) have theirs, whose attention
seam is an `AttentionInterface` function.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Wrapper = Callable[..., Any]  # wrapper(fn, *args, **kwargs): runs fn(*args, **kwargs), e.g. under a checkpoint


@dataclass(frozen=True)
class LogitTransform:
    """What a model's forward does to `head(hidden)` before its loss, as ops applied in order: ("float", 1.0)
    upcasts, ("scale", s) multiplies, ("softcap", c) is c·tanh(logits / c). Empty: the logits are the head's."""

    ops: tuple[tuple[str, float], ...] = ()
    source: str = ""  # where it was read (the model's class), for messages
    # How the model's own loss reads `labels=`: shifted inside (transformers' causal-LM loss) or as given (a few
    # decoders, TrOCR and XLNet, take labels already shifted). The heads' targets are always the next tokens.
    shifts_labels: bool = True

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        for op, value in self.ops:
            if op == "float":
                logits = logits.float()
            elif op == "scale":
                logits = logits * value
            else:  # softcap
                logits = torch.tanh(logits / value) * value
        return logits

    @property
    def scale(self) -> float | None:
        """The one factor the transform amounts to where it is only scaling (1.0: none), so a fused op can take it
        on its input; None where it is not linear (soft-capping)."""
        if any(op == "softcap" for op, _ in self.ops):
            return None
        return math.prod(v for op, v in self.ops if op == "scale")

    def describe(self) -> str:
        parts = {"float": lambda v: "fp32", "scale": lambda v: f"× {v:g}", "softcap": lambda v: f"{v:g}·tanh(·/{v:g})"}
        return ", ".join(parts[op](v) for op, v in self.ops) or "none"


@dataclass(frozen=True)
class LayerOutput:
    """What the model's loop takes from a layer's return value: the tensor itself ("tensor"), or element 0 of a
    tuple of `width` elements ("first"; the rest is dropped or only collected for outputs a run never asks for);
    "passes_more": the loop hands the next layer more than the hidden states; "repeats": an outer loop calls the
    layers again (Dory's recurrent section). Neither can be grouped: a group runs each layer once, in order."""

    kind: str = "tensor"  # tensor | first | passes_more | repeats (a loop calls the layers again)
    width: int = 1

    @property
    def groupable(self) -> bool:
        return self.kind not in ("passes_more", "repeats")

    @property
    def why_not_groupable(self) -> str:
        if self.kind == "repeats":
            return "calls its layers more than once in a forward (a recurrent loop over them)"
        return "hands each layer more than the hidden states (e.g. router state)"

    def hidden_of(self, out: Any) -> Any:
        return out[0] if self.kind == "first" and isinstance(out, (tuple, list)) else out

    def stand_in(self, hidden: torch.Tensor) -> Any:
        """What a grouped layer before the segment's last returns in place of running: what the loop reads as the
        unchanged hidden states."""
        return hidden if self.kind == "tensor" else (hidden, *([None] * (self.width - 1)))


class DecoderAdapter:
    """Base: what every family shares (layer forward overrides); subclasses say where things are."""

    family: str = "?"

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    # -- where things are (per family) ---------------------------------------------------------------------------
    @property
    def layers(self) -> nn.ModuleList:
        raise NotImplementedError

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def head(self) -> nn.Linear:
        raise NotImplementedError

    @property
    def attention(self) -> str:
        raise NotImplementedError

    @property
    def has_attention_seam(self) -> bool:
        """Can layer attention's core be wrapped (`wrap_core_attention`), whatever it is configured to run?"""
        return True

    @property
    def logit_transform(self) -> LogitTransform:
        return LogitTransform()

    @property
    def layer_output(self) -> LayerOutput:
        """How the model's loop reads a layer's return. Grouped policies (several blocks as one region) pass the
        stream through the earlier layers of a group, which is only right when nothing else flows between them."""
        return LayerOutput()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's own logits from final hidden states: the head, then the family's transform."""
        return self.logit_transform(self.head(hidden))

    def wrap_core_attention(self, i: int, wrapper: Wrapper | None) -> None:
        raise NotImplementedError

    def attention_module(self, i: int) -> nn.Module | None:
        """Layer i's attention: the module that holds its projections and core and whose only dropout is the core's
        (under tensor parallelism, what a rank runs on its own heads); None for a layer without attention."""
        raise NotImplementedError

    def tensor_parallel_plan(self, sequence_parallel: bool) -> dict[str, Any] | None:
        """torch ParallelStyles by module path (`*` for any layer, as `parallelize_module` reads them; a tuple for
        several on one module, applied in order) that split the model Megatron's way over a tensor-parallel mesh;
        None where the family has no plan."""
        return None

    def tensor_parallel_divisors(self) -> dict[str, int]:
        """The sizes a tensor-parallel degree must divide, by the config key that sets each."""
        return {}

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------------------------------
    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def tied_head(self) -> bool:
        """Is the head's weight an embedding's (the token embedding's, tied)? By identity, not by shape."""
        weight = self.head.weight
        return any(isinstance(m, nn.Embedding) and m.weight is weight for m in self.model.modules())

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def override_forward(self, i: int, fn: Callable[..., torch.Tensor] | None) -> None:
        """Run layer i's calls through `fn` (an instance attribute, so no module is wrapped and state_dict keys
        stay as they are); None restores the class's forward."""
        layer = self.layers[i]
        if fn is None:
            layer.__dict__.pop("forward", None)
        else:
            layer.forward = fn

    def original_forward(self, i: int) -> Callable[..., torch.Tensor]:
        """Layer i's own forward, bypassing an override (and, being a bound method, bypassing module hooks)."""
        layer = self.layers[i]
        return type(layer).forward.__get__(layer)


@dataclass(frozen=True)
class FamilySpec:
    """A model family as it registers itself (in its own module): which models are its, its adapter, and how a
    config node becomes one of its models. `check` runs the family's own checks on a config node (None: none)."""

    name: str
    owns: Callable[[nn.Module], bool]
    adapter: Callable[[nn.Module], DecoderAdapter]
    build: Callable[[Any, int | None, Any], nn.Module]  # (config node, tokenizer vocab or None, loaded HF config)
    check: Callable[[Any], None] | None = None
    # Its test size, as data: the conf/model preset and the model.* overrides that shrink it. Family-wide tests and
    # benches iterate the registry with these, so a new family is in them without editing them (None: hf, whose
    # tests build tiny configs of transformers' families instead).
    preset: str | None = None
    tiny: Mapping[str, Any] = field(default_factory=dict)

    @property
    def tiny_overrides(self) -> list[str]:
        """Hydra overrides for the family's test-size model."""
        return [f"model={self.preset}", *(f"model.{k}={v}" for k, v in self.tiny.items())]


FAMILIES: dict[str, FamilySpec] = {}  # the only list of families, filled by each family's module on import


def register_family(spec: FamilySpec) -> FamilySpec:
    FAMILIES[spec.name] = spec
    return spec


def family_of(model: nn.Module) -> FamilySpec:
    """The family that owns `model`; the latest registered that claims it, so a family whose model subclasses
    another's (registered after it) is its own."""
    for spec in reversed(FAMILIES.values()):
        if spec.owns(model):
            return spec
    raise TypeError(
        f"{type(model).__name__} is of no registered family ({', '.join(FAMILIES)}); a family registers a "
        "FamilySpec (models/adapter.py) with its adapter to meet the decoder contract"
    )


def adapter_for(model: nn.Module) -> DecoderAdapter:
    """The contract for `model`, from the family that owns it (kept on the model, outside its state_dict)."""
    cached = model.__dict__.get("_decoder_adapter")
    if cached is not None:
        return cached
    adapter = family_of(model).adapter(model)
    model.__dict__["_decoder_adapter"] = adapter  # not a submodule, not in state_dict
    return adapter
