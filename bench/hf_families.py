"""Every causal-LM family the installed transformers registers, through the project's real entry points.

    python -m bench.hf_families                                   # every family, one at a time (hours on 2 cores)
    python -m bench.hf_families --families llama,gpt2,mamba --jobs 2
    python -m bench.hf_families --policies full,selective --out runs/bench/hf_families/mine
    python -m bench.hf_families --resume runs/bench/hf_families/<stamp>   # go on where a sweep stopped
    python -m bench.hf_families --render runs/bench/hf_families/<stamp> --write-readme   # table only, no run

The families are `transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: the registry, not a
hand list. For each one, in its own subprocess (a crash or a hang ends that family's row, not the sweep; `--timeout`
seconds each), the sweep

1. builds a tiny config: the family's defaults (`AutoConfig.for_model`) with every size field that exists shrunk
   (`shrink`: width 64, 4 heads of 16 with 2 key-value heads, feed-forward 64, vocabulary 320, 128 positions, 4
   experts choosing 2, windows ≤ 16, 2 layers or the fewest that keep the family's pattern of layer types, dropout
   0.1 wherever the config names one; sub-configs such as `text_config` likewise), plus the few per-family
   `OVERRIDES` below where the generic shrink fails; a family that needs images or audio, or is an
   encoder-decoder, is refused here, and one whose own forward (transformers alone) fails on the tiny config is
   broken here, not in the project;
2. saves it to a folder and composes `model=hf model.name_or_path=<folder> model.attention=eager data.tokenizer=byte`
   as train.py would (`trainer.schema.compose_config`); a model with no eager attention path is retried with
   `model.attention=sdpa`;
3. loads it with `models.build_model`, its config read by `trainer.build.hf_config` (the adapter finds its layers);
4. "loss = the model's own": `DecoderModule.loss_of((x, y))` of the module `trainer.build.module` makes, y = x
   shifted left with the last column -100, against `model(input_ids=x, labels=x).loss`, dropout 0 and eval(), fp32,
   within 1e-5 relative, the output projection scaled ×50 first (logits of tens: a softcap or scale the model
   applies after its head changes the loss; at random init's ±0.5 it would not);
5. `trainer.check.run_check` for each policy (2 optimizer steps against `none`, bitwise on CPU);
6. estimate = run, as tests/test_estimate.py holds it: `trainer.session.measure(open_session(config), policy)`
   against a real `trainer.run.train` run's `activation_peak_mib` and `peak_total_mib`, for each of
   `--estimate-policies` (default none and every checked policy), within 64 bytes.

A row's status: "refused" when the project refused the family in one line (its user errors, the `UserError`s that
`describe_user_error` knows: HFModelError, ConfigError, PolicyError, DataError) or it needs non-text inputs;
"broken" when anything raised something else (a traceback: its type and first line; the whole of it is in
logs/<family>.log), a check differed, the estimate missed the run or the loss missed the model's own, or the family
timed out (the log's last stage mark says where); "passed" otherwise (a policy the project refuses for that family,
e.g. selective for a model with no attention seam, or an estimate the fake tensors cannot run, is in the row's notes
and marked in the summary).

Written to --out as each family finishes: rows.jsonl (one JSON row per line, what --resume reads), results.json,
results.csv and summary.md; `--write-readme` puts summary.md between the hf-families markers of README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import datetime as dt
import functools
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench._readme import README, ROOT, cpu_name, replace_block

START, END = "<!-- hf-families:start -->", "<!-- hf-families:end -->"
HEADING = "## Measured: every Hugging Face causal-LM family"
COMMAND = "python -m bench.hf_families"
POLICIES = ("full", "selective", "op_sac", "sqrt", "every_k")
ESTIMATE_POLICIES = ("none", *POLICIES)
LOSS_TOLERANCE = 1e-5  # relative, fp32
LOGIT_GAIN = 50.0  # the output projection scaled for the loss comparison (random init gives logits of ±0.5)
ESTIMATE_SLACK_BYTES = 64  # tests/test_estimate.py's bound: the run holds one of Lightning's scalars more
TIMEOUT_S = 300.0  # a hybrid's estimate on fake tensors takes ~25 s a policy here (zamba: 3 min in all)
STAGE_MARK = "hf_families stage: "
MAX_PARAMS = 5_000_000  # a tiny config above this missed a size field (every family's is below 1M today)
MEMORY_MIB = 4096  # the child's data segment: a family that runs away fails alone, on a shared machine

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


# ----------------------------------------------------------------------------------------------------
# One family, through the project's entry points.
# ----------------------------------------------------------------------------------------------------


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def classify(e: BaseException) -> tuple[str, str]:
    """("refused", its one line) for the project's user errors (`describe_user_error` knows them), else ("broken",
    "Type: first line")."""
    from trainer.schema import describe_user_error

    line = describe_user_error(e)
    if line is not None:
        return "refused", " ".join(line.split())
    return "broken", f"{type(e).__name__}: {_first_line(e)}"


def overrides_for(folder: Path, attention: str, *extra: str) -> list[str]:
    """The command line a user would give train.py for this folder (byte tokens fit the 320-id vocabulary)."""
    return [
        "model=hf",
        f"model.name_or_path={folder}",
        f"model.attention={attention}",
        "data.tokenizer=byte",
        "seq_len=32",
        "batch_size=2",
        "precision=32-true",
        "trainer.enable_progress_bar=false",
        *extra,
    ]


# tests/test_estimate.py's run: two steps, the second measured
RUN = [
    "trainer.max_steps=2",
    "trainer.enable_checkpointing=false",
    "trainer.val_batches=1",
    "measure.warmup_steps=1",
    "measure.activation_every_n_steps=1",
]


def empty_row(model_type: str) -> dict[str, Any]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {
        "model_type": model_type,
        "class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "?"),
        "status": "passed",
        "stage": "",  # where a refused or broken row stopped
        "loads": False,
        "attention": None,
        "n_layer": None,
        "params": None,
        "checks": {},  # policy: {"result": bitwise | within … | differs | refused | broken, "detail": …}
        "estimate": {},  # policy: {"activation_bytes", "activation_off", "peak_bytes", "peak_off"} or {"error"}
        "loss": {},  # {"ours", "own", "rel_diff", "labels"} or {"error"}
        "reason": "",
        "notes": [],
        "tiny": {},  # the fields changed from the family's defaults
        "seconds": {},
    }


class FamilyRun:
    """One family's stages, each filling its part of the row; the first refusal or failure names the row."""

    def __init__(self, model_type: str, workdir: Path) -> None:
        self.model_type, self.workdir = model_type, workdir
        self.row = empty_row(model_type)
        self.folder = workdir / "model"
        self.attention = "eager"

    def fail(self, stage: str, status: str, reason: str, tb: bool = False) -> None:
        row = self.row
        if row["status"] == "passed" or (row["status"] == "refused" and status == "broken"):
            row["status"], row["stage"], row["reason"] = status, stage, f"{stage}: {reason}"
        if tb and status == "broken":
            row.setdefault("traceback", traceback.format_exc())

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a stage; an exception in it is the row's refusal or failure, and ends the stage."""
        start = time.perf_counter()
        print(f"{STAGE_MARK}{name}", file=sys.stderr, flush=True)  # the log says where a family that hangs hung
        try:
            yield
        except Exception as e:
            status, line = classify(e)
            self.fail(name, status, line, tb=True)
            raise _Stop from None
        finally:
            self.row["seconds"][name] = round(time.perf_counter() - start, 2)

    def compose(self, *extra: str) -> Any:
        from trainer.schema import compose_config

        return compose_config(overrides_for(self.folder, self.attention, *extra))

    def config(self) -> bool:
        """The tiny config, saved; False when the family needs more than text (refused on its defaults) or its own
        forward fails on the tiny config (broken: the sweep's shrink or transformers, not the project)."""
        import torch
        import transformers

        values, why = OVERRIDES.get(self.model_type, ({}, ""))
        if values is None:
            self.fail("inputs", "refused", f"{self.row['class']}: {why}")
            return False
        defaults = default_config(self.model_type)
        reason = non_text_reason(self.model_type, self.row["class"], defaults)
        if reason:
            self.fail("inputs", "refused", reason)
            return False
        config, changed = tiny_config(self.model_type, defaults)
        self.row["tiny"] = {k: v for k, v in changed.items() if not isinstance(v, dict)}
        if values:
            self.row["notes"].append(f"override {values}: {why}")
        with torch.device("meta"):  # nothing allocated: a size the shrink missed must not take the machine's memory
            params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        if params > MAX_PARAMS:
            raise ValueError(f"the tiny config still has {params:,} parameters (> {MAX_PARAMS:,}): a missed size")
        try:  # transformers alone, no project code: what fails here is the tiny config's (or transformers') fault
            torch.manual_seed(0)
            own = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config))
            x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
            own(input_ids=x, labels=x, use_cache=False).loss.backward()
        except Exception as e:
            self.fail(
                "tiny config", "broken", f"the model's own forward fails on it: {type(e).__name__}: {_first_line(e)}"
            )
            self.row["traceback"] = traceback.format_exc()
            return False
        config.save_pretrained(self.folder)
        return True

    def load(self) -> None:
        """`models.build_model` on the composed config; no eager attention path: again with sdpa."""
        from models import build_model
        from models.adapter import adapter_for
        from trainer import build

        try:
            cfg = self.compose()
            model = build_model(cfg.model, vocab_size=build.vocab(cfg), hf_config=build.hf_config(cfg))
        except Exception as e:
            status, line = classify(e)
            if status != "refused" or "no eager attention path" not in line:
                raise
            self.row["notes"].append("no eager attention path: model.attention=sdpa")
            self.attention = "sdpa"
            cfg = self.compose()
            model = build_model(cfg.model, vocab_size=build.vocab(cfg), hf_config=build.hf_config(cfg))
        adapter = adapter_for(model)
        self.row.update(loads=True, attention=self.attention, n_layer=adapter.n_layer, params=adapter.num_parameters())
        self.row["class"] = type(model).__name__

    def loss(self) -> None:
        """`DecoderModule.loss_of((x, y))` against `model(input_ids=x, labels=x).loss`, dropout 0, eval()."""
        import torch

        from trainer import build

        cfg = self.compose("model.dropout=0.0")
        torch.manual_seed(cfg.seed)
        module = build.module(cfg, "none", vocab_size=build.vocab(cfg), hf_config=build.hf_config(cfg)).eval()
        x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        y = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
        with torch.no_grad():
            module.adapter.head.weight.mul_(LOGIT_GAIN)  # logits of tens: a softcap or scale after the head shows
            ours = float(module.loss_of((x, y)))
            own = float(module.model(input_ids=x, labels=x, use_cache=False).loss)
            rel = abs(ours - own) / max(abs(own), 1e-12)
            self.row["loss"] = {"ours": ours, "own": own, "rel_diff": rel, "labels": "x"}
            if not rel <= LOSS_TOLERANCE:  # some causal LMs (BART's decoder) take their labels already shifted
                pre = float(module.model(input_ids=x, labels=y, use_cache=False).loss)
                if abs(ours - pre) <= LOSS_TOLERANCE * max(abs(pre), 1e-12):
                    rel = abs(ours - pre) / max(abs(pre), 1e-12)
                    self.row["loss"].update(own=pre, rel_diff=rel, labels="shifted")
                    self.row["notes"].append(f"{self.row['class']} does not shift its labels: compared with labels=y")
        if not rel <= LOSS_TOLERANCE:
            self.fail(
                "loss", "broken", f"the training loss {ours:.6g} ≠ the model's own {own:.6g} ({rel:.3g} relative)"
            )

    def check(self, policy: str) -> None:
        """`trainer.check.run_check`: 2 steps of the policy against `none` (bitwise on CPU)."""
        from trainer.check import run_check

        try:
            result = run_check(self.compose(f"policy={policy}"), steps=2)
        except Exception as e:
            status, line = classify(e)
            self.row["checks"][policy] = {"result": status, "detail": line}
            if status == "refused":
                self.row["notes"].append(f"{policy} refused: {line}")
                return
            raise
        if result.equal:
            how = "bitwise" if result.exact else f"within {result.tolerance:g}"
            self.row["checks"][policy] = {"result": how, "detail": result.plan}
        else:
            self.row["checks"][policy] = {"result": "differs", "detail": result.first_failure}
            self.fail(f"check {policy}", "broken", f"differs from none: {result.first_failure}")

    def estimate(self, policy: str) -> None:
        """`trainer.estimate.measure` against a real `trainer.run.train` run of the same config."""
        from trainer.memory import MIB
        from trainer.policies import build_policy
        from trainer.run import train
        from trainer.session import measure, open_session

        try:
            cfg = self.compose(f"policy={policy}", *RUN)
            est = measure(open_session(cfg), build_policy(cfg.policy))
            summary = train(self.compose(f"policy={policy}", *RUN), self.workdir / f"run-{policy}")
        except Exception as e:
            status, line = classify(e)
            self.row["estimate"][policy] = {"error": line}
            if status == "refused":
                self.row["notes"].append(f"estimate {policy} refused: {line}")
                return
            raise
        act = est.activation_bytes - round(summary["activation_peak_mib"] * MIB)
        peak = est.peak_bytes - round(summary["peak_total_mib"] * MIB)
        self.row["estimate"][policy] = {
            "activation_bytes": est.activation_bytes,
            "activation_off": act,
            "peak_bytes": est.peak_bytes,
            "peak_off": peak,
        }
        if max(abs(act), abs(peak)) > ESTIMATE_SLACK_BYTES:
            self.fail(f"estimate {policy}", "broken", f"estimate ≠ run: activation {act:+,} B, peak {peak:+,} B")

    def run(self, policies: Sequence[str], estimate_policies: Sequence[str]) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            with self.stage("tiny config"):
                if not self.config():
                    return self.row
            with self.stage("load"):
                self.load()
            # From here on a stage that fails leaves the others to run: the row shows everything that differs.
            for name, step in [
                ("loss", self.loss),
                *((f"check {p}", functools.partial(self.check, p)) for p in policies),
                *((f"estimate {p}", functools.partial(self.estimate, p)) for p in estimate_policies),
            ]:
                with contextlib.suppress(_Stop), self.stage(name):
                    step()
            checks = self.row["checks"]
            if checks and all(c["result"] == "refused" for c in checks.values()):
                details = sorted({c["detail"] for c in checks.values()})
                self.fail("check", "refused", "every policy refused: " + " | ".join(details))
        except _Stop:
            pass
        finally:
            self.row["seconds"]["total"] = round(time.perf_counter() - t0, 2)
        return self.row


class _Stop(Exception):
    """A stage failed; its row says how."""


def family_row(
    model_type: str,
    policies: Sequence[str] = POLICIES,
    estimate_policies: Sequence[str] = ESTIMATE_POLICIES,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """One family's row (see the module doc). Never raises for the family's own failures: they are the row."""
    if workdir is not None:
        return FamilyRun(model_type, Path(workdir)).run(policies, estimate_policies)
    with tempfile.TemporaryDirectory(prefix=f"hf-{model_type}-") as tmp:
        return FamilyRun(model_type, Path(tmp)).run(policies, estimate_policies)


# ----------------------------------------------------------------------------------------------------
# The sweep: one subprocess per family, results written as each finishes.
# ----------------------------------------------------------------------------------------------------


def registered_families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def child_env() -> dict[str, str]:
    """No network, one BLAS thread (2 shared cores), no warnings in the logs' way."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "TRANSFORMERS_VERBOSITY": "error",
        "TOKENIZERS_PARALLELISM": "false",
    }


def broken_row(model_type: str, reason: str, seconds: float) -> dict[str, Any]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {
        "model_type": model_type,
        "class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "?"),
        "status": "broken",
        "stage": "process",
        "loads": False,
        "attention": None,
        "n_layer": None,
        "params": None,
        "checks": {},
        "estimate": {},
        "loss": {},
        "reason": f"process: {reason}",
        "notes": [],
        "tiny": {},
        "seconds": {"total": round(seconds, 2)},
    }


class Job:
    def __init__(self, model_type: str, args: argparse.Namespace, out: Path) -> None:
        self.model_type = model_type
        self.row_file = out / "rows" / f"{model_type}.json"
        self.log_file = out / "logs" / f"{model_type}.log"
        self.row_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "bench.hf_families",
            "--one",
            model_type,
            "--row",
            str(self.row_file),
            "--policies",
            ",".join(args.policies),
            "--estimate-policies",
            ",".join(args.estimate_policies),
            "--memory-mib",
            str(args.memory_mib),
        ]
        self.log = self.log_file.open("w")
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=child_env(),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def kill(self) -> None:
        """End this job's process group (the child and whatever it started), nothing else."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def row(self, timed_out: bool, timeout: float) -> dict[str, Any]:
        self.log.close()
        if timed_out:
            marks = [ln for ln in self.log_file.read_text(errors="replace").splitlines() if ln.startswith(STAGE_MARK)]
            where = f" in {marks[-1][len(STAGE_MARK) :]}" if marks else ""
            return broken_row(self.model_type, f"timed out after {timeout:g} s{where}", self.elapsed())
        if self.row_file.is_file():
            return json.loads(self.row_file.read_text())
        code = self.proc.returncode
        why = f"killed by signal {-code}" if code < 0 else f"exited {code} without a row"
        tail = [ln for ln in self.log_file.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        return broken_row(self.model_type, why + (f" ({tail[0][:200]})" if tail else ""), self.elapsed())


def sweep(args: argparse.Namespace, out: Path, families: list[str], log: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = read_rows(out)
    done = {r["model_type"] for r in rows}
    todo = [f for f in families if f not in done]
    if done:
        log(f"{len(done)} families already in {out / 'rows.jsonl'}; {len(todo)} to go")
    meta = {"env": environment(args), "command": command_line(args), "families": families}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    running: list[Job] = []
    total, finished = len(todo), 0
    signal.signal(signal.SIGTERM, _terminated)  # `kill <pid>` of a background sweep ends its families too
    pending = list(todo)
    try:
        while pending or running:
            while pending and len(running) < args.jobs:
                running.append(Job(pending.pop(0), args, out))
            time.sleep(0.2)
            for job in list(running):
                timed_out = job.proc.poll() is None and job.elapsed() > args.timeout
                if timed_out:
                    job.kill()
                elif job.proc.poll() is None:
                    continue
                running.remove(job)
                row = job.row(timed_out, args.timeout)
                rows.append(row)
                with (out / "rows.jsonl").open("a") as f:
                    f.write(json.dumps(row) + "\n")
                write_results(out, rows, meta)
                finished += 1
                seconds = row["seconds"].get("total", 0)
                reason = f" {row['reason']}" if row["reason"] else ""
                log(f"[{finished}/{total}] {row['model_type']}: {row['status']} ({seconds:.0f} s){reason}")
    finally:
        for job in running:
            job.kill()
    write_results(out, rows, meta)
    return rows


def _terminated(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def read_rows(out: Path) -> list[dict[str, Any]]:
    path = out / "rows.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    latest = {r["model_type"]: r for r in rows}  # a family run twice: its last row
    return list(latest.values())


# ----------------------------------------------------------------------------------------------------
# Results: JSON, CSV, markdown.
# ----------------------------------------------------------------------------------------------------


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    return {
        "date": dt.date.today().isoformat(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "cpu": cpu_name(),
        "policies": list(args.policies),
        "estimate_policies": list(args.estimate_policies),
        "timeout_s": args.timeout,
        "jobs": args.jobs,
    }


def command_line(args: argparse.Namespace) -> str:
    parts = [COMMAND]
    if args.families:
        parts.append(f"--families {','.join(args.families)}")
    if tuple(args.policies) != POLICIES:
        parts.append(f"--policies {','.join(args.policies)}")
    if list(args.estimate_policies) != ["none", *(p for p in args.policies if p != "none")]:
        parts.append(f"--estimate-policies {','.join(args.estimate_policies)}")
    return " ".join(parts)


def check_cell(check: dict[str, Any] | None) -> str:
    if not check:
        return ""
    result = check["result"]
    return result if result in ("bitwise", "refused") or result.startswith("within") else f"{result}: {check['detail']}"


def estimate_cell(estimate: dict[str, Any]) -> str:
    cells = []
    for name, e in estimate.items():
        if "error" in e:
            cells.append(f"{name}: {e['error']}")
        else:
            cells.append(f"{name}: {e['activation_off']:+d}/{e['peak_off']:+d} B")
    return "; ".join(cells)


def flat(row: dict[str, Any], policies: Sequence[str]) -> dict[str, Any]:
    """One CSV line: the row's fields, one column per policy."""
    loss = row.get("loss") or {}
    out = {k: row.get(k) for k in ("model_type", "class", "status", "stage", "loads", "attention", "n_layer", "params")}
    out.update({f"check_{p}": check_cell(row["checks"].get(p)) for p in policies})
    out["estimate_off_bytes"] = estimate_cell(row.get("estimate") or {})
    out["loss_rel_diff"] = loss.get("rel_diff", loss.get("error", ""))
    out["reason"] = row.get("reason", "")
    out["notes"] = " | ".join(row.get("notes") or [])
    out["seconds"] = (row.get("seconds") or {}).get("total")
    return out


def write_results(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    policies = meta["env"]["policies"]
    order = {f: i for i, f in enumerate(meta["families"])}
    rows = sorted(rows, key=lambda r: order.get(r["model_type"], len(order)))
    _atomic(out / "results.json", json.dumps({**meta, "rows": rows}, indent=1, default=str))
    buf = io.StringIO()
    lines = [flat(r, policies) for r in rows]
    writer = csv.DictWriter(buf, fieldnames=list(flat(rows[0], policies)) if rows else ["model_type"])
    writer.writeheader()
    writer.writerows(lines)
    _atomic(out / "results.csv", buf.getvalue())
    _atomic(out / "summary.md", markdown(rows, meta) + "\n")


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    env = meta["env"]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("passed", "refused", "broken")}
    seconds = [r["seconds"].get("total", 0) for r in rows]
    registered = len(meta["families"])
    header = (
        f"Generated by `{meta['command']}` ({env['date']}, transformers {env['transformers']}, torch {env['torch']}, "
        f"CPU {env['cpu']}; policies checked: {', '.join(env['policies']) or 'none'}; estimate = run for "
        f"{', '.join(env['estimate_policies']) or 'none'}; {sum(seconds) / 60:.0f} min, "
        f"{(sum(seconds) / len(seconds) if seconds else 0):.0f} s per family)."
    )
    lines = [
        header,
        "",
        f"**{len(rows)} of {registered} families**: {counts['passed']} passed, {counts['refused']} refused, "
        f"{counts['broken']} broken.",
    ]
    bad = [r for r in rows if r["status"] != "passed"]
    if bad:
        lines += ["", "| family | class | status | reason |", "|---|---|---|---|"]
        for r in sorted(bad, key=lambda r: (r["status"] != "broken", r["model_type"])):
            lines.append(f"| `{r['model_type']}` | {r['class']} | {r['status']} | {_cell(r['reason'])} |")
    passed = [r for r in rows if r["status"] == "passed"]
    if passed:

        def name(r: dict[str, Any]) -> str:
            refused = [p for p, c in r["checks"].items() if c["result"] == "refused"]
            marks = [*(["sdpa"] if r.get("attention") == "sdpa" else []), *(f"no {p}" for p in refused)]
            estimates = r.get("estimate") or {}
            if estimates and all("error" in e for e in estimates.values()):
                marks.append("no estimate")
            return f"`{r['model_type']}`" + (f" ({', '.join(marks)})" if marks else "")

        lines += ["", f"Passed ({len(passed)}): " + ", ".join(name(r) for r in passed) + "."]
        lines += [
            "",
            "Passed: loads through `models.build_model`, every checked policy equal to `none` under `trainer.check` "
            "(bitwise) or refused by the project in one line (marked `no <policy>`), the estimate equal to a real "
            f"run within {ESTIMATE_SLACK_BYTES} B or refused in one line (`no estimate`), and the training loss equal "
            "to the model's own within "
            f"{LOSS_TOLERANCE:g} relative; `sdpa`: no eager attention path, checked with `model.attention=sdpa`.",
        ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# The command line.
# ----------------------------------------------------------------------------------------------------


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from trainer.schema import OneLineParser

    ap = OneLineParser(prog=COMMAND, description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--families", type=_names, default=None, help="comma-separated model types (default: every one)")
    ap.add_argument("--policies", type=_names, default=list(POLICIES), help=f"default {','.join(POLICIES)}")
    ap.add_argument(
        "--estimate-policies",
        type=_names,
        default=None,
        help="policies whose estimate is held to a real run (default: none and every checked policy)",
    )
    ap.add_argument("--out", type=Path, default=None, help="results folder (default runs/bench/hf_families/<stamp>)")
    ap.add_argument("--resume", type=Path, default=None, help="a results folder to go on with (skips its families)")
    ap.add_argument("--render", type=Path, default=None, help="only render an existing results folder")
    ap.add_argument("--jobs", type=int, default=1, help="families at once (default 1)")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help=f"seconds per family (default {TIMEOUT_S:g})")
    ap.add_argument(
        "--memory-mib", type=int, default=MEMORY_MIB, help=f"each family's memory cap in MiB (default {MEMORY_MIB})"
    )
    ap.add_argument("--write-readme", action="store_true", help=f"put the table between {START} and {END}")
    ap.add_argument("--readme", type=Path, default=README, help="the README that --write-readme rewrites")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child: one family
    ap.add_argument("--row", type=Path, help=argparse.SUPPRESS)  # where the child writes its row
    args = ap.parse_args(argv)
    if args.estimate_policies is None:
        args.estimate_policies = ["none", *(p for p in args.policies if p != "none")]
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs} must be ≥ 1")
    if not args.timeout > 0:
        ap.error(f"--timeout {args.timeout} must be > 0")
    if sum(x is not None for x in (args.out, args.resume, args.render)) > 1:
        ap.error("give one of --out, --resume and --render")
    from trainer.policies import POLICIES as REGISTERED

    for p in (*args.policies, *args.estimate_policies):
        if p not in REGISTERED:
            ap.error(f"unknown policy {p!r}; choose from {', '.join(REGISTERED)}")
    return args


def readme_markers_error(path: Path) -> str | None:
    text = path.read_text() if path.is_file() else ""
    if START in text and END in text and text.index(START) < text.index(END):
        return None
    return f"{path} has no {START} … {END} markers; add them where the table goes, then rerun"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """transformers, Lightning and the policies' one-time notices at errors only (they would bury the row in the
    log), restored on the way out."""
    names = (
        "transformers",
        "lightning",
        "lightning.pytorch",
        "lightning.fabric",
        "trainer.policies",
        "lightning.pytorch.utilities.rank_zero",
        "lightning.fabric.utilities.rank_zero",
    )
    levels = {n: logging.getLogger(n).level for n in names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in names:
            logging.getLogger(n).setLevel(logging.ERROR)
        try:
            yield
        finally:
            for n, level in levels.items():
                logging.getLogger(n).setLevel(level)


def child(args: argparse.Namespace) -> int:
    import resource

    import torch

    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = args.memory_mib * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    torch.set_num_threads(1)
    with quiet():
        row = family_row(args.one, args.policies, args.estimate_policies)
    if "traceback" in row:
        print(row["traceback"], file=sys.stderr)
    args.row.parent.mkdir(parents=True, exist_ok=True)
    _atomic(args.row, json.dumps(row, default=str))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        return child(args)

    def log(line: str) -> None:
        print(line, flush=True)

    if args.write_readme:
        problem = readme_markers_error(args.readme)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    if args.render is not None:
        meta_file = args.render / "meta.json"
        if not meta_file.is_file():
            print(f"error: --render {args.render}: no meta.json there; give a folder this sweep wrote", file=sys.stderr)
            return 2
        meta, rows = json.loads(meta_file.read_text()), read_rows(args.render)
        write_results(args.render, rows, meta)
        out = args.render
    else:
        registered = registered_families()
        families = args.families or registered
        unknown = [f for f in families if f not in registered]
        if unknown:
            print(
                f"error: --families: {', '.join(unknown)} not in transformers' causal-LM registry "
                f"(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, {len(registered)} families)",
                file=sys.stderr,
            )
            return 2
        stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        out = args.resume or args.out or ROOT / "runs" / "bench" / "hf_families" / stamp
        out.mkdir(parents=True, exist_ok=True)
        log(f"{len(families)} families, {args.jobs} at a time, {args.timeout:g} s each at most → {out}")
        rows = sweep(args, out, families, log)
        meta = json.loads((out / "meta.json").read_text())
    text = (out / "summary.md").read_text()
    print("\n" + text)
    if args.write_readme:
        replace_block(args.readme, START, END, text.rstrip("\n"), HEADING)
        print(f"wrote {args.readme}", file=sys.stderr)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("passed", "refused", "broken")}
    log(f"{out}: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" (meta {len(meta['families'])} families)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
