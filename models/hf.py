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

import contextlib
import copy
import fnmatch
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models import hf_source, hub
from models.adapter import DecoderAdapter, FamilySpec, LayerOutput, LogitTransform, Wrapper, register_family
from models.errors import UserError

log = logging.getLogger(__name__)
ATTENTION_NAME = "ckptlab_eager"
WRAPPER_ATTR = "ckptlab_core_wrapper"  # set on an attention module by a policy: run its core through this


class HFModelError(UserError):
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


def _eager_function(module: nn.Module | type) -> Any:
    """The model's own eager attention (each modeling_<model>.py defines `eager_attention_forward`). A model FSDP2
    has sharded is of a generated subclass (FSDP<name>, defined in torch): its own class is the other base."""
    from torch.distributed.fsdp import FSDPModule

    cls = module if isinstance(module, type) else type(module)
    if issubclass(cls, FSDPModule):
        cls = next(b for b in cls.__bases__ if b is not FSDPModule)
    return getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)


def model_class(config: Any) -> type:
    """The causal-LM class transformers builds for `config`."""
    transformers = _transformers()
    return transformers.AutoModelForCausalLM._model_mapping[type(config)]


def has_attention_seam(cls: type) -> bool:
    """Does the family run attention through a function transformers lets us swap (its modeling module's
    `eager_attention_forward`)? Falcon, Bloom and MPT compute it inline: no core to wrap."""
    return _eager_function(cls) is not None


def best_attention(cls: type) -> str:
    """What transformers itself runs when no attention is named: SDPA where the family has it, else eager."""
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def attention_choice(cls: type) -> str:
    """The line a run prints when it chose the attention itself (model.attention=null)."""
    chosen = best_attention(cls)
    if chosen == "sdpa":
        return f"model.attention=null: {cls.__name__} runs SDPA (model.attention=eager: the scores selective drops)"
    return (
        f"model.attention=null: {cls.__name__} has no SDPA attention in transformers {_transformers().__version__}; "
        "it runs its eager attention"
    )


def attn_implementation(cls: type, attention: str | None) -> str:
    """What to ask transformers for, or a one-line HFModelError, decided from the class before it is built.

    eager: the seam (`ckptlab_eager`) where the family routes attention through a swappable function (its modeling
    module has `eager_attention_forward`); elsewhere (Falcon, Bloom, MPT compute it inline) transformers' own eager
    implementation, which runs every policy but `selective`. sdpa: only where the family has it. None: the best the
    family has (`best_attention`), as transformers picks when none is named."""
    attention = attention or best_attention(cls)
    if attention == "eager":
        return ATTENTION_NAME if has_attention_seam(cls) else "eager"
    if not getattr(cls, "_supports_sdpa", False):
        version = _transformers().__version__
        raise HFModelError(f"{cls.__name__} has no SDPA attention in transformers {version}; use model.attention=eager")
    return "sdpa"


def _ckptlab_eager(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
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
            raise HFModelError(
                f"model.name_or_path={name_or_path}: no such folder; give a folder with config.json or a hub id"
            )
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
    attention: str | None = "sdpa",
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
    impl = attn_implementation(model_class(config), attention)
    if pretrained:
        where, local_only, _ = resolve(name_or_path)
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                where, config=config, attn_implementation=impl, local_files_only=local_only, dtype=torch.float32
            )
        except Exception as e:
            raise HFModelError(
                f"model.name_or_path={name_or_path}: cannot load its weights ({_one_line(e, 160)}); "
                "model.pretrained=false initialises them from the config instead"
            ) from None
    else:
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float32)
        except Exception as e:  # transformers refuses its own config (e.g. an inconsistent layer pattern)
            raise HFModelError(
                f"model.name_or_path={name_or_path}: transformers cannot build it from its config ({_one_line(e, 160)})"
            ) from None
    model.config.use_cache = False  # training: no KV cache
    adapter = HFAdapter(model)
    adapter.logit_transform  # noqa: B018  (a head the loss cannot follow is refused now, not at the first step)
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
        self._owner, self._attr, self._layers = self._find_layers()
        if self.base is model:  # base_model_prefix names no attribute (Llama-4 text): the layers' owner is it
            self.base = self._owner
        self._transform: LogitTransform | None = None
        self._layer_output: LayerOutput | None = None
        # HF's own eager, e.g. a model built outside load_causal_lm: the seam runs that same eager function, so the
        # logits are unchanged (tested). A family that computes attention inline keeps HF's eager and has no seam.
        if model.config._attn_implementation == "eager" and self.has_attention_seam:
            register_attention()
            model.set_attn_implementation(ATTENTION_NAME)

    def _find_layers(self) -> tuple[nn.Module, str, nn.ModuleList]:
        """(the module that owns the decoder layers, its attribute, the list): the ModuleList of the class the model
        names as its unit of sharding (`_no_split_modules`) anywhere under the base model (OPT keeps it under
        `decoder.layers`); without one, the base model's only non-empty ModuleList."""
        units = set(getattr(self.model, "_no_split_modules", None) or [])
        found: list[tuple[nn.Module, str, nn.ModuleList]] = []
        for owner in self.base.modules():
            for attr, child in owner.named_children():
                if isinstance(child, nn.ModuleList) and len(child) > 0 and type(child[0]).__name__ in units:
                    found.append((owner, attr, child))
        if found:
            return max(found, key=lambda f: len(f[2]))  # a vision tower's blocks may be units too: the longest
        direct = [(a, m) for a, m in self.base.named_children() if isinstance(m, nn.ModuleList) and len(m) > 0]
        if len(direct) == 1:
            return self.base, direct[0][0], direct[0][1]
        raise HFModelError(
            f"{type(self.model).__name__}: no ModuleList of its decoder-layer class ({sorted(units) or 'none named'}"
            f" in _no_split_modules) under {type(self.base).__name__}, so there are no layers for a policy to treat"
        )

    @property
    def layers(self) -> nn.ModuleList:
        return self._layers

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """The causal LM is called as a whole (hooks on it run: FSDP2's root all-gather), asked for logits at no
        position (`logits_to_keep`: an empty index), and the last hidden state is taken on its way out of the base
        model by a forward hook (or out of the module that runs the layers, where the causal LM calls that one
        directly: OPT's `model.decoder`)."""
        seen: dict[str, torch.Tensor] = {}

        def keep(name: str) -> Any:
            def hook(_m: nn.Module, _a: Any, out: Any) -> None:  # returns None: the output stays as it is
                hidden = getattr(out, "last_hidden_state", None)  # a ModelOutput, or (BLT) the tensor itself
                seen.setdefault(name, hidden if hidden is not None else out[0] if isinstance(out, tuple) else out)

            return hook

        hooks = [self.base.register_forward_hook(keep("base"))]
        if self._owner is not self.base:
            hooks.append(self._owner.register_forward_hook(keep("owner")))
        head = self.head
        if self.model.__dict__.get("tensor_parallel_degree", 1) > 1:
            # Split (trainer/parallel/tensor.py): DTensor's sharding rules divide by zero viewing the head's output of
            # no positions, so the head's call is an empty one (the module call still runs its hooks)
            head.forward = lambda h: h.new_zeros(*h.shape[:-1], 0)
        try:
            self.model(input_ids=idx, use_cache=False, logits_to_keep=idx.new_zeros(0))
        finally:
            head.__dict__.pop("forward", None)
            for hook in hooks:
                hook.remove()
        return seen["base"] if "base" in seen else seen["owner"]

    @property
    def head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def logit_transform(self) -> LogitTransform:
        """Read once from the causal LM's forward (models/hf_source.py); a head the loss heads cannot follow is
        refused in one line rather than trained on another objective."""
        if self._transform is None:
            found = hf_source.head_transform(self.model)
            if isinstance(found, str):
                raise HFModelError(f"{found}; the loss heads would train another objective than the model's own")
            self._transform = found
        return self._transform

    @property
    def attention(self) -> str:
        return "eager" if self.model.config._attn_implementation in (ATTENTION_NAME, "eager") else "sdpa"

    def attention_module(self, i: int) -> nn.Module | None:
        """Layer i's attention (the module with `config` and `is_causal`), or None: a hybrid model's state-space
        layer (Jamba's Mamba layers) has none."""
        layer = self.layers[i]
        for m in layer.modules():
            if m is not layer and hasattr(m, "is_causal") and hasattr(m, "config"):
                return m
        return None

    @property
    def has_attention_seam(self) -> bool:
        return has_attention_seam(type(self.model))

    @property
    def layer_output(self) -> LayerOutput:
        if self._layer_output is None:
            read = hf_source.layer_output(self._owner, self._attr)
            if read is None:  # no loop to read: what the layers' own source returns
                tuples = any(hf_source.returns_a_tuple(cls) for cls in {type(layer) for layer in self.layers})
                read = LayerOutput("passes_more") if tuples else LayerOutput()
            self._layer_output = read
        return self._layer_output

    def wrap_core_attention(self, i: int, wrapper: Wrapper | None) -> None:
        module = self.attention_module(i)
        if module is None:  # no attention in this layer: no core to recompute
            return
        if wrapper is None:
            module.__dict__.pop(WRAPPER_ATTR, None)
        else:
            module.__dict__[WRAPPER_ATTR] = wrapper

    def tensor_parallel_plan(self, sequence_parallel: bool) -> dict[str, Any] | None:
        """transformers' own `base_model_tp_plan` (its "colwise" and "rowwise" entries), under the base model's path;
        the embedding split by vocabulary (untied), and every other module that holds parameters (the norms, the
        head) whole on each rank, its weights replicated. transformers' plans carry no sequence parallelism, so it is
        refused (ValueError) rather than half applied."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from models.tensor_parallel import Replicated

        base_plan = getattr(self.model.config, "base_model_tp_plan", None)
        if not base_plan:
            return None
        if sequence_parallel:
            raise ValueError(
                f"{type(self.model).__name__}: transformers' base_model_tp_plan has no sequence parallelism; set "
                "trainer.sequence_parallel=false"
            )
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        unknown = sorted({v for v in base_plan.values() if v not in styles})
        if unknown:
            raise ValueError(
                f"{type(self.model).__name__}: its base_model_tp_plan uses {', '.join(unknown)}, which this project "
                "does not map to a torch style (colwise and rowwise only); use trainer.tensor_parallel=1"
            )
        names = {id(m): n for n, m in self.model.named_modules()}
        prefix = names[id(self.base)]
        plan: dict[str, Any] = {f"{prefix}.{k}" if prefix else k: styles[v]() for k, v in base_plan.items()}
        if not self.tied_head:  # (tied: the shared weight stays whole with the head, below)
            plan[names[id(self.model.get_input_embeddings())]] = RowwiseParallel(input_layouts=Replicate())
        # The head stays whole on each rank (its logits whole, as a split head would gather them)
        for name, module in self.model.named_modules():
            split = any(fnmatch.fnmatchcase(name, pattern) for pattern in plan)
            if name and not split and any(True for _ in module.parameters(recurse=False)):
                plan[name] = Replicated()
        return plan

    def tensor_parallel_divisors(self) -> dict[str, int]:
        c = self.model.config
        heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", None) or 1
        return {
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(c, "num_key_value_heads", None) or heads,
            "vocab_size": self.head.weight.shape[0],
        }

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
            "logit_transform": self.logit_transform.describe(),
            "tied_head": self.tied_head,
            "params": self.num_parameters(),
        }


def max_positions(config: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:  # -1 (XLNet): no limit
            return value
    return None


def _build(cfg: Any, vocab_size: int | None = None, hf_config: Any = None) -> nn.Module:
    """model=hf from a config node: its own vocabulary (cfg.vocab_size overrides it, on a copy of the config)."""
    config = copy.deepcopy(hf_config) if hf_config is not None else load_config(str(cfg.name_or_path))
    if cfg.vocab_size is not None:  # on a copy: the caller's loaded config stays as it was read
        config.vocab_size = cfg.vocab_size
    return load_causal_lm(str(cfg.name_or_path), cfg.pretrained, cfg.attention, cfg.dropout, config=config)


def _owns(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # a model of it exists only once it is imported
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _check(cfg: Any) -> None:
    if not cfg.name_or_path:
        raise ValueError("model=hf needs model.name_or_path=<hub id or a local folder with config.json>")
    if cfg.attention is None:  # settled once, here, so every tool and policy check sees what will run
        cls = model_class(load_config(str(cfg.name_or_path)))
        cfg.attention = best_attention(cls)
        log.info(attention_choice(cls))


register_family(FamilySpec("hf", owns=_owns, adapter=HFAdapter, build=_build, check=_check))
