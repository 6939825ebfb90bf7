"""The registry sweep's tiny configs: a family's defaults with every size field that exists shrunk."""

from __future__ import annotations

import json
import re
from typing import Any

# ----------------------------------------------------------------------------------------------------
# The tiny config: the family's defaults, every size field that exists shrunk.
# ----------------------------------------------------------------------------------------------------

WIDTH, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, POSITIONS = 64, 4, 2, 16, 64, 320, 128
EXPERTS, TOP_K, WINDOW, DROPOUT, MIN_LAYERS, MAX_LAYERS = 4, 2, 16, 0.1, 2, 8

WIDTH_KEYS = set(
    (
        "hidden_size n_embd d_model dim emb_dim embed_dim model_dim embedding_size embedding_dim "
        "word_embed_proj_dim input_embedding_size output_embedding_size attention_hidden_size "
        "backbone_hidden_size hidden_size_global"
    ).split()
)
FFN_KEYS = re.compile(
    r"intermediate_size|ffn_dim|ffn_hidden_size|feed_forward_size|^(n_inner|d_ff|dff|d_inner|dim_ff)$"
)
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers")
ENCODER_LAYER_KEYS = {"encoder_layers", "num_encoder_layers"}
HEAD_KEYS = set(
    (
        "num_attention_heads n_head n_heads num_heads attention_heads decoder_attention_heads "
        "encoder_attention_heads num_decoder_attention_heads swa_num_attention_heads "
        "linear_num_value_heads linear_num_heads mamba_n_heads mamba_num_heads n_mamba_heads "
        "index_n_heads"
    ).split()
)
KV_HEAD_KEYS = set(
    (
        "num_key_value_heads num_kv_heads n_kv_heads n_kv_head multi_query_group_num num_query_groups "
        "swa_num_key_value_heads linear_num_key_heads"
    ).split()
)
HEAD_DIM_SUFFIXES = ("head_dim", "head_size", "d_head", "dim_head")
POSITION_KEYS = set(
    (
        "max_position_embeddings n_positions n_ctx max_seq_len seq_length max_target_positions "
        "max_source_positions original_max_position_embeddings"
    ).split()
)
EXPERT_KEYS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_routed"}
TOP_K_KEYS = {
    "num_experts_per_tok",
    "num_experts_per_token",
    "moe_topk",
    "moe_top_k",
    "top_k",
    "moe_k",
    "num_selected_experts",
}
AT_MOST_ONE = set(
    (
        "n_shared_experts num_shared_experts moe_num_shared_experts n_group num_expert_group topk_group "
        "first_k_dense_replace num_dense_layers n_groups mamba_n_groups mamba_ngroups"
    ).split()
)
WINDOW_KEYS = set(
    (
        "sliding_window sliding_window_size attention_window_size window_size attention_chunk_size "
        "local_attention_window_len"
    ).split()
)
SMALL = {
    "state_size": 8,
    "mamba_d_state": 8,
    "ssm_state_size": 8,
    "d_state": 8,
    "mamba_dt_rank": 8,
    "time_step_rank": 8,
    "dt_rank": 8,
    "hidden_size_per_layer_input": 16,
    "laurel_rank": 8,
    "zero_expert_num": 2,
    "rotary_dim": HEAD_DIM // 2,
    "hc_lowrank": 16,
}
RATIO_KEYS = {"attention_hidden_size", "backbone_hidden_size", "word_embed_proj_dim"}
PERIODS = {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1}
# Where a (heads, head size, expansion) triple must multiply out to expansion × width (Mamba-2 style state heads).
SSM_HEADS = (
    ("num_heads", "head_dim", "expand"),
    ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
    ("mamba_num_heads", "mamba_head_dim", "mamba_expand"),
)
SSM_WIDTH = {"mamba_d_ssm"}  # the state path's width: heads × head size
DROPOUT_SUFFIXES = ("dropout", "pdrop", "dropout_prob")  # what models.hf.load_causal_lm's `dropout` sets
NOT_SUB_CONFIGS = {"id2label", "label2id", "rope_parameters", "rope_scaling", "per_layer_config"}
NON_TEXT = tuple(
    (
        "vision_config audio_config vq_config audio_encoder audio_encoder_config vision_tower "
        "speech_config image_config"
    ).split()
)

# Per-family values, only where the generic shrink fails: {model_type: (values, why)}. A dict value is merged into
# the sub-config of that name; a layer count here sets the layer count (per-layer lists are cut to it). Values None:
# the family cannot run on token ids alone, and `why` is the row's refusal.
OVERRIDES: dict[str, tuple[dict[str, Any] | None, str]] = {
    "gemma4_assistant": (None, "a drafter: its forward needs the target model's shared_kv_states beside the text"),
    "gemma4_unified_assistant": (None, "a drafter: its forward needs the target model's shared_kv_states"),
    "xmod": (None, "its forward needs a language id for its adapters (set_default_language) beside the text"),
    "diffllama": ({"attention_dropout": 0.0}, "DiffLlama refuses attention_dropout > 0 (no defined semantics)"),
    "mpt": ({"attn_config": {"attn_pdrop": 0}}, "MptAttentionConfig types attn_pdrop as int: 0.1 is refused"),
    "dots3_note_text": (
        {
            "num_key_value_heads": 4,
            "per_layer_config": {
                "02": {"num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 8}
            },
        },
        "its config requires num_key_value_heads == num_attention_heads, per layer too",
    ),
    "dots3_note": ({"num_key_value_heads": 4}, "its config requires num_key_value_heads == num_attention_heads"),
    "reformer": (
        {"axial_pos_embds_dim": [32, 32], "axial_pos_shape": [4, 8]},
        "its axial position embeddings must sum to the width and multiply to the sequence length (32)",
    ),
    "zamba": ({"num_hidden_layers": 8}, "the shared transformer's tied weights need two hybrid layers (2 and 7)"),
    "dory": (
        {"num_hidden_layers": 8, "n_input_layers": 2, "n_recurrent_layers": 4, "n_output_layers": 2},
        "its saved config counts an MLP entry per layer (counts doubled): 4 layers, 1 + 2 + 1",
    ),
    # Families whose default config does not build in this transformers (a field left None that the model uses):
    "cohere_compass_text": (
        {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
        "default build: rope_parameters must be keyed by layer type",
    ),
    "dbrx": (
        {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
        "default build: the attention reads attn_config.rope_theta, and clamps to clip_qkv (None)",
    ),
    "dots1": (
        {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
        "default build: n_routed_experts is None",
    ),
    "lfm2_moe": ({"layer_types": ["conv", "full_attention"]}, "default build: layer_types is None"),
    "qwen4_exp_text": (
        {
            "indexer_n_heads": 4,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 16,
            "indexer_budget": 16,
            "indexer_compress_ratio": 4,
        },
        "default build: the indexer's sizes are None",
    ),
}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shrunk_value(key: str, v: Any) -> Any:
    """The tiny value of one field, or `v` when the field is not a size this sweep shrinks."""
    if key.endswith(DROPOUT_SUFFIXES) and _number(v):
        return DROPOUT
    if v is None:  # "derived" sizes that some models then fail to derive: given explicitly
        return {"head_dim": HEAD_DIM, **dict.fromkeys(KV_HEAD_KEYS, KV_HEADS), **dict.fromkeys(TOP_K_KEYS, TOP_K)}.get(
            key
        )
    if isinstance(v, list) and v and all(_int(x) for x in v):  # per-layer sizes (gemma3n's intermediate_size)
        return [_shrunk_value(key, x) for x in v]
    if not _int(v):
        return v
    if key.endswith(("token_id", "token_index")):
        return _token(v)
    if "vocab_size" in key or key.endswith("_vocab"):
        return min(v, VOCAB)
    if key in WIDTH_KEYS or key.endswith("_embed_dim"):
        return WIDTH
    if FFN_KEYS.search(key) or key in SSM_WIDTH:
        return FFN
    if key in ENCODER_LAYER_KEYS:
        return MIN_LAYERS
    if key in KV_HEAD_KEYS:
        return KV_HEADS
    if key in HEAD_KEYS:
        return HEADS
    if key in ("qk_nope_head_dim", "qk_rope_head_dim"):  # MLA: the two halves make one head
        return HEAD_DIM // 2
    if key.endswith(HEAD_DIM_SUFFIXES):
        return HEAD_DIM
    if key.endswith("lora_rank"):
        return 2 * HEAD_DIM
    if key in SMALL:
        return min(v, SMALL[key])
    for keys, limit in (
        (POSITION_KEYS, POSITIONS),
        (EXPERT_KEYS, EXPERTS),
        (TOP_K_KEYS, TOP_K),
        (AT_MOST_ONE, 1),
        (WINDOW_KEYS, WINDOW),
    ):
        if key in keys:
            return min(v, limit)
    return PERIODS.get(key, v)


def _token(v: Any) -> Any:
    """A special token's id inside the tiny vocabulary (ids past it fold to the top of it)."""
    if isinstance(v, list):
        return [_token(x) for x in v]
    return VOCAB - 1 - (v % 16) if _int(v) and v >= VOCAB else v


def _layers(values: dict[str, Any], count: int | None = None) -> dict[str, Any]:
    """The layer count and every per-layer list cut to `count`, else to the fewest layers (≥ 2) that keep each
    list's kinds (gemma3's five sliding layers and a full one: 6); index lists (the layers that are full attention,
    dense, ...) and per-layer dicts keyed by index keep the layers below the new count, which covers the first."""
    key = next((k for k in LAYER_KEYS if _int(values.get(k))), None)
    if key is None:
        return {}
    n = values[key]
    per_layer = {k: list(v) for k, v in values.items() if isinstance(v, (list, tuple)) and len(v) == n and n > 1}
    index = {
        k: list(v)
        for k, v in values.items()
        if k not in per_layer
        and isinstance(v, (list, tuple))
        and v
        and all(_int(i) and 0 <= i < n for i in v)
        and len(v) < n
        and k.endswith(("layers", "idxs", "ids", "indices"))
    }
    keyed = {
        k: v
        for k, v in values.items()
        if isinstance(v, dict) and v and k not in ("id2label", "label2id") and all(str(i).isdigit() for i in v)
    }
    if count is None:
        need = max([MIN_LAYERS, *(min(v) + 1 for v in index.values())])
        fits = (
            k
            for k in range(need, MAX_LAYERS + 1)
            if all(len({_key(x) for x in v[:k]}) == len({_key(x) for x in v}) for v in per_layer.values())
        )
        count = min(n, next(fits, max(need, MAX_LAYERS)))
        if _int(values.get("num_kv_shared_layers")) and values["num_kv_shared_layers"] > 0:
            count = min(n, 2 * count)  # the last half reuses the first half's caches: each half holds every kind
    if _int(values.get("num_kv_shared_layers")) and values["num_kv_shared_layers"] > 0:
        out_shared = {"num_kv_shared_layers": count // 2}
    else:
        out_shared = {}
    out: dict[str, Any] = {key: count, **out_shared}
    out.update({k: [_shrunk_value(k, x) for x in v[:count]] for k, v in per_layer.items()})
    out.update({k: [i for i in v if i < count] for k, v in index.items()})
    out.update({k: {i: _shrunk_dict(c) for i, c in v.items() if int(i) < count} for k, v in keyed.items()})
    return out


def _shrunk_dict(v: Any) -> Any:
    return {k: _shrunk_value(k, x) for k, x in v.items()} if isinstance(v, dict) else v


def _key(v: Any) -> Any:
    return json.dumps(v, sort_keys=True, default=str) if isinstance(v, (dict, list)) else v


def _is_sub_config(key: str, v: Any) -> bool:
    return isinstance(v, dict) and key not in NOT_SUB_CONFIGS and ("model_type" in v or key.endswith("_config"))


def shrink(values: dict[str, Any], overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The changed fields of one config level (a `to_dict()`), sub-configs included, as keyword arguments;
    `overrides` (a family's OVERRIDES values) on top, merged into sub-configs."""
    overrides = overrides or {}
    changed: dict[str, Any] = {}
    for k, v in values.items():
        if _is_sub_config(k, v):
            sub = shrink(v, overrides.get(k) if isinstance(overrides.get(k), dict) else None)
            if sub:
                changed[k] = {**v, **sub}
            continue
        new = _shrunk_value(k, v)
        if new != v or type(new) is not type(v):
            changed[k] = new
    if values.get("is_decoder") is False:  # BERT-likes' *LMHeadModel: causal only as a decoder (else it warns)
        changed["is_decoder"] = True
    count = next((overrides[k] for k in LAYER_KEYS if k in overrides and k in values), None)
    changed.update(_layers(values, count))
    for heads, size, expand in SSM_HEADS:  # Mamba-2 style: heads × head size = expansion × width
        if all(_int(values.get(k)) for k in (heads, size, expand)) and values[heads] * values[size] == values[
            expand
        ] * next((values[k] for k in ("hidden_size", "d_model") if _int(values.get(k))), -1):
            changed[heads] = values[expand] * WIDTH // changed.get(size, values[size])
    if _int(values.get("qk_nope_head_dim")) and _int(values.get("qk_rope_head_dim")) and "qk_head_dim" in values:
        changed["qk_head_dim"] = changed.get("qk_nope_head_dim", 0) + changed.get("qk_rope_head_dim", 0)
    if _int(values.get("kv_lora_rank")) and any(_int(values.get(k)) for k in KV_HEAD_KEYS):  # MLA: no GQA
        changed.update({k: HEADS for k in KV_HEAD_KEYS if _int(values.get(k))})
    if _int(values.get("qk_rope_head_dim")) and values.get("head_dim") == values["qk_rope_head_dim"]:
        changed["head_dim"] = changed["qk_rope_head_dim"]  # MLA's rotary table is sized by head_dim (DeepSeek)
    width = next((values[k] for k in ("hidden_size", "d_model", "n_embd") if _int(values.get(k))), None)
    for k in WIDTH_KEYS & RATIO_KEYS:  # a multiple of the width stays that multiple (Zamba's 2 × hidden)
        if width and _int(values.get(k)) and values[k] % width == 0:
            changed[k] = WIDTH * (values[k] // width)
    changed.update({k: v for k, v in overrides.items() if not _is_sub_config(k, values.get(k))})
    return changed


def default_config(model_type: str) -> Any:
    """The family's config class defaults (with its OVERRIDES where the defaults alone do not build)."""
    import transformers

    try:
        return transformers.AutoConfig.for_model(model_type)
    except Exception:
        extra = OVERRIDES.get(model_type, ({}, ""))[0]
        if not extra:  # (None: a family refused before its config is read)
            raise
        return transformers.AutoConfig.for_model(model_type, **extra)


def tiny_config(model_type: str, defaults: Any = None) -> tuple[Any, dict[str, Any]]:
    """(the family's tiny config, the values changed from its defaults)."""
    import transformers

    defaults = defaults if defaults is not None else default_config(model_type)
    changed = shrink(defaults.to_dict(), OVERRIDES.get(model_type, ({}, ""))[0] or {})
    return transformers.AutoConfig.for_model(model_type, **changed), changed


def non_text_reason(model_type: str, class_name: str, config: Any) -> str | None:
    """Why this family's causal-LM class needs more than token ids, or None."""
    values = config.to_dict()
    for key in NON_TEXT:
        if values.get(key) is not None:
            return f"{class_name} needs non-text inputs ({key} in {type(config).__name__}): a multimodal model"
    if values.get("is_encoder_decoder"):
        return (
            f"{type(config).__name__} is an encoder-decoder: {class_name} is its decoder half, whose "
            "cross-attention has no encoder states to attend to in a text-only batch"
        )
    if class_name.endswith("ForConditionalGeneration"):
        return f"{class_name} is a conditional-generation model (inputs beside the text), not a text decoder"
    return None
