"""A Hugging Face causal LM behind the decoder contract (models/adapter.py). Needs the `hf` extra (transformers).

    model = load_causal_lm("path/to/folder_with_config.json", pretrained=False, attention="eager")
    adapter_for(model).layers        # the decoder layers, found by the model's own `_no_split_modules`

`name_or_path` is a hub id (online, or cached) or a local folder with `config.json`; `pretrained=False` initialises
the weights from the config, `True` loads them. The decoder layers are the ModuleList of the base model whose
elements are the class the model names as its unit of sharding (`_no_split_modules`).

The attention seam: with `attention="eager"` the model runs the attention function registered here as
`ckptlab_eager`, which calls the model's own `eager_attention_forward` (its modeling module's; GQA's key/value
repeat is inside it) and, where a policy asked for it, runs that call under the policy's wrapper (a checkpoint, so
`selective` recomputes the core). With `attention="sdpa"` the model runs HF's SDPA function, which keeps no T×T
scores. Registering through `AttentionInterface` is how transformers lets a caller swap attention code without
touching the model.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import functools
import inspect
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models import hub
from models.adapter import DecoderAdapter, Wrapper

ATTENTION_NAME = "ckptlab_eager"
WRAPPER_ATTR = "ckptlab_core_wrapper"  # set on an attention module by a policy: run its core through this


class HFModelError(ValueError):
    """A model that cannot be loaded or used; the message is one line that names the fix."""


def _one_line(e: BaseException, limit: int = 240) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise HFModelError(
            "model=hf needs the transformers package: pip install -e '.[hf]' (or pip install transformers)"
        ) from None
    return transformers


def _eager_function(module: nn.Module) -> Any:
    """The model's own eager attention (each modeling_<model>.py defines `eager_attention_forward`)."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _ckptlab_eager(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:  # fmt: skip
    eager = _eager_function(module)
    if eager is None:  # refused at load time; kept as a clear failure should a model change under us
        raise HFModelError(f"{type(module).__name__} has no eager_attention_forward to run")
    wrapper = module.__dict__.get(WRAPPER_ATTR)
    if wrapper is None:
        return eager(module, query, key, value, attention_mask, **kwargs)
    return wrapper(eager, module, query, key, value, attention_mask, **kwargs)


def register_attention() -> None:
    transformers = _transformers()
    from transformers.masking_utils import eager_mask

    transformers.AttentionInterface.register(ATTENTION_NAME, _ckptlab_eager)
    # The mask too: transformers builds no mask at all for an attention name its mask registry does not know, and
    # the eager core would then attend to later tokens. The core is HF's eager one, so its mask is HF's eager mask.
    transformers.AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)


def resolve(name_or_path: str) -> tuple[str, bool, str]:
    """(what to pass to from_pretrained, local_files_only, why local only), or a one-line HFModelError: a folder must
    hold config.json; a hub id offline must be in the local cache (no retry loop)."""
    path = Path(name_or_path).expanduser()
    if path.exists() or name_or_path.startswith((".", "/", "~")):
        if not path.is_dir():
            raise HFModelError(f"model.name_or_path={name_or_path}: no such folder; give a folder with config.json "
                               "or a hub id")  # fmt: skip
        if not (path / "config.json").is_file():
            raise HFModelError(
                f"model.name_or_path={name_or_path}: the folder has no config.json; point it at a saved Hugging "
                "Face model (save_pretrained) or give a hub id"
            )
        return str(path), True, "a local folder"
    if hub.offline_requested():
        return name_or_path, True, "offline mode is on (HF_HUB_OFFLINE)"
    ok, endpoint = hub.reachable()
    if not ok:
        return name_or_path, True, f"hub {endpoint} is unreachable"  # try the cache
    return name_or_path, False, ""


def load_config(name_or_path: str) -> Any:
    transformers = _transformers()
    where, local_only, why = resolve(name_or_path)
    try:
        config = transformers.AutoConfig.from_pretrained(where, local_files_only=local_only)
    except Exception as e:
        if local_only and not Path(where).is_dir():
            raise HFModelError(
                f"cannot load hub model {name_or_path!r} offline and no cached copy ({why}): {_one_line(e, 120)}; "
                "run once online to cache it, or give model.name_or_path=<a local folder with config.json>"
            ) from None
        raise HFModelError(f"model.name_or_path={name_or_path}: cannot read its config ({_one_line(e, 160)})") from None
    mapping = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING
    if type(config) not in mapping:
        raise HFModelError(
            f"model.name_or_path={name_or_path} is a {type(config).__name__} ({config.model_type}), not a causal "
            "language model; give a decoder such as Llama, GPT-2, Qwen2 or Mistral"
        )
    return config


def load_causal_lm(
    name_or_path: str,
    pretrained: bool = False,
    attention: str = "sdpa",
    dropout: float | None = None,
    config: Any = None,
) -> nn.Module:
    """The causal LM of `name_or_path`, its weights loaded (`pretrained`) or initialised from the config (seeded by
    the caller's torch RNG). `dropout` (None: the config's) sets every dropout probability the config names."""
    transformers = _transformers()
    register_attention()
    config = copy.deepcopy(config) if config is not None else load_config(name_or_path)  # the caller's stays
    if dropout is not None:  # every probability the config names: *dropout, *pdrop, *dropout_prob (0 may be an int)
        for key, value in config.to_dict().items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if number and key.endswith(("dropout", "pdrop", "dropout_prob")) and hasattr(config, key):
                setattr(config, key, float(dropout))
    impl = ATTENTION_NAME if attention == "eager" else "sdpa"
    if pretrained:
        where, local_only, _ = resolve(name_or_path)
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                where, config=config, attn_implementation=impl, local_files_only=local_only, dtype=torch.float32
            )
        except Exception as e:
            raise HFModelError(f"model.name_or_path={name_or_path}: cannot load its weights ({_one_line(e, 160)}); "
                               "model.pretrained=false initialises them from the config instead") from None  # fmt: skip
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float32)
    model.config.use_cache = False  # training: no KV cache
    adapter = HFAdapter(model)
    if attention == "eager" and not adapter.has_eager_path:
        raise HFModelError(
            f"{type(model).__name__} has no eager attention path (no eager_attention_forward in its modeling "
            "module); use model.attention=sdpa (and a policy other than selective)"
        )
    return model


@contextlib.contextmanager
def as_on_real_tensors() -> Iterator[None]:
    """Run an HF model on fake tensors the way it runs on real ones (the estimator's fake run).

    transformers' mask helpers take a FakeTensor for a traced graph: `find_packed_sequence_indices` then returns its
    packed-sequence mask instead of testing it, and the model builds an explicit (B, 1, T, T) attention mask that a
    real run of the same unpacked batch never builds (it returns None and attention runs `is_causal`). Within this
    context the helper computes what it always computes and returns what it returns on real, unpacked positions.
    """
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = masking_utils.find_packed_sequence_indices

    def unpacked(position_ids: torch.Tensor) -> None:
        original(position_ids)  # the same temporaries as on real tensors
        return None  # the positions are arange: one sequence per row

    masking_utils.find_packed_sequence_indices = unpacked
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def load_tokenizer(name_or_path: str) -> Any:
    """The model's own tokenizer (data.tokenizer=model), or a one-line HFModelError when it has none."""
    transformers = _transformers()
    where, local_only, _ = resolve(name_or_path)
    try:
        return transformers.AutoTokenizer.from_pretrained(where, local_files_only=local_only)
    except Exception as e:
        raise HFModelError(
            f"data.tokenizer=model: {name_or_path} has no tokenizer that loads ({_one_line(e, 160)}); use "
            "data.tokenizer=byte or bpe (with model.vocab_size large enough), or save a tokenizer beside the model"
        ) from None


class HFAdapter(DecoderAdapter):
    family = "hf"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.base = model.base_model
        self._layers = self._find_layers()
        if model.config._attn_implementation == "eager":  # HF's own eager, e.g. a model built outside load_causal_lm
            register_attention()  # the seam runs that same eager function, so the logits are unchanged (tested)
            model.set_attn_implementation(ATTENTION_NAME)

    def _find_layers(self) -> nn.ModuleList:
        units = set(getattr(self.model, "_no_split_modules", None) or [])
        lists = [m for m in self.base.children() if isinstance(m, nn.ModuleList) and len(m) > 0]
        for ml in lists:
            if units and type(ml[0]).__name__ in units:
                return ml
        if len(lists) == 1:
            return lists[0]
        raise HFModelError(
            f"{type(self.model).__name__}: cannot tell which ModuleList holds the decoder layers "
            f"(candidates: {[type(m[0]).__name__ for m in lists]}, _no_split_modules={sorted(units)})"
        )

    @property
    def layers(self) -> nn.ModuleList:
        return self._layers

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """The causal LM is called as a whole (hooks on it run: FSDP2's root all-gather), asked for logits at no
        position (`logits_to_keep`: an empty index), and the base model's last hidden state is taken on its way
        out by a forward hook."""
        seen: list[torch.Tensor] = []
        hook = self.base.register_forward_hook(lambda _m, _a, out: seen.append(out.last_hidden_state))
        try:
            self.model(input_ids=idx, use_cache=False, logits_to_keep=idx.new_zeros(0))
        finally:
            hook.remove()
        return seen[0]

    @property
    def head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def attention(self) -> str:
        return "eager" if self.model.config._attn_implementation == ATTENTION_NAME else "sdpa"

    def _attention_module(self, i: int) -> nn.Module | None:
        """Layer i's attention (the module with `config` and `is_causal`), or None: a hybrid model's state-space
        layer (Jamba's Mamba layers) has none."""
        layer = self.layers[i]
        for m in layer.modules():
            if m is not layer and hasattr(m, "is_causal") and hasattr(m, "config"):
                return m
        return None

    @property
    def has_eager_path(self) -> bool:
        modules = (self._attention_module(i) for i in range(self.n_layer))
        first = next((m for m in modules if m is not None), None)
        return first is not None and _eager_function(first) is not None

    @property
    def layers_return_hidden_only(self) -> bool:
        return not any(_returns_a_tuple(cls) for cls in {type(layer) for layer in self.layers})

    def wrap_core_attention(self, i: int, wrapper: Wrapper | None) -> None:
        module = self._attention_module(i)
        if module is None:  # no attention in this layer: no core to recompute
            return
        if wrapper is None:
            module.__dict__.pop(WRAPPER_ATTR, None)
        else:
            module.__dict__[WRAPPER_ATTR] = wrapper

    def describe(self) -> dict[str, Any]:
        c = self.model.config
        n_head = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", None)
        return {
            "family": "hf",
            "model_type": c.model_type,
            "class": type(self.model).__name__,
            "n_layer": self.n_layer,
            "n_embd": getattr(c, "hidden_size", None) or getattr(c, "n_embd", None),
            "n_head": n_head,
            "n_kv_head": getattr(c, "num_key_value_heads", None) or n_head,
            "vocab_size": self.head.weight.shape[0],
            "block_size": max_positions(c),
            "attention": self.attention,
            "attn_implementation": c._attn_implementation,  # e.g. sdpa or flash_attention_2 behind "sdpa"
            "tied_head": self.tied_head,
            "params": self.num_parameters(),
        }


@functools.cache
def _returns_a_tuple(layer_class: type) -> bool:
    """Does this decoder layer's forward return a tuple literal (`return hidden_states, router_state`)? Read from its
    source, since transformers' return annotations say `tuple` for many layers that return the tensor alone."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(layer_class.forward)))
    except (OSError, TypeError, SyntaxError):
        return False  # no source to read: the group runner's own check catches a tuple at the first step
    return any(isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) for node in ast.walk(tree))


def max_positions(config: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None
