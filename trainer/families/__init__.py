"""Every causal-LM family the installed transformers registers, through the project's real entry points.

    python -m trainer.families                                   # every family, one at a time (hours on 2 cores)
    python -m trainer.families --families llama,gpt2,mamba --jobs 2
    python -m trainer.families --policies full,selective --out runs/trainer/families/mine
    python -m trainer.families --resume runs/trainer/families/<stamp>   # go on where a sweep stopped
    python -m trainer.families --render runs/trainer/families/<stamp> --write-docs   # table only, no run

The families are `transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: the registry, not a
hand list. For each one, in its own subprocess (a crash or a hang ends that family's row, not the sweep; `--timeout`
seconds each), the sweep

1. builds a tiny config: the family's defaults (`AutoConfig.for_model`) with every size field that exists shrunk
   (`shrink`: width 64, 4 heads of 16 with 2 key-value heads, feed-forward 64, vocabulary 320, 128 positions, 4
   experts choosing 2, windows ≤ 16, 2 layers or the fewest that keep the family's pattern of layer types, dropout
   0.1 wherever the config names one; sub-configs such as `text_config` likewise), plus the few per-family
   `OVERRIDES` (configs.py) where the generic shrink fails; a family that needs images or audio, or is an
   encoder-decoder, is refused here, and one whose own forward (transformers alone) fails on the tiny config is
   broken here, not in the project;
2. saves it to a folder and composes `model=hf model.name_or_path=<folder> model.attention=eager data.tokenizer=byte`
   as train.py would (`trainer.core.schema.compose_config`); a model with no eager attention path is retried with
   `model.attention=sdpa`;
3. loads it with `models.build_model`, its config read by `trainer.core.build.hf_config` (the adapter finds its layers);
4. "loss = the model's own": `DecoderModule.loss_of((x, y))` of the module `trainer.core.build.module` makes, y = x
   shifted left with the last column -100, against `model(input_ids=x, labels=x).loss`, dropout 0 and eval(), fp32,
   within 1e-5 relative, the output projection scaled ×50 first (logits of tens: a softcap or scale the model
   applies after its head changes the loss; at random init's ±0.5 it would not);
5. `trainer.check.compare.run_check` for each policy (2 optimizer steps against `none`, bitwise on CPU);
6. estimate = run, as tests/test_estimate.py holds it: `trainer.estimate.measure(open_session(config), policy)`
   against a real `trainer.core.run.train` run's `activation_peak_mib` and `peak_total_mib`, for each of
   `--estimate-policies` (default none and every checked policy), within 64 bytes.

A row's status: "refused" when the project refused the family in one line (its user errors, the `UserError`s that
`describe_user_error` knows: HFModelError, ConfigError, PolicyError, DataError) or it needs non-text inputs;
"broken" when anything raised something else (a traceback: its type and first line; the whole of it is in
logs/<family>.log), a check differed, the estimate missed the run or the loss missed the model's own, or the family
timed out (the log's last stage mark says where); "passed" otherwise (a policy the project refuses for that family,
e.g. selective for a model with no attention seam, or an estimate the fake tensors cannot run, is in the row's notes
and marked in the summary).

Written to --out as each family finishes: rows.jsonl (one JSON row per line, what --resume reads), results.json,
results.csv and summary.md; `--write-docs` (formerly `--write-readme`) puts summary.md between the hf-families markers
of docs/hf-families.md.

Inside: `configs` (the tiny config), `family` (one family's row) and `sweep` (the sweep, its results, the command
line: `python -m trainer.families`).
"""

from trainer.families.configs import VOCAB, _layers, default_config, non_text_reason, shrink, tiny_config
from trainer.families.family import ESTIMATE_SLACK_BYTES, LOSS_TOLERANCE, POLICIES, FamilyRun, family_row
from trainer.families.sweep import END, START, broken_row, main, markdown, quiet, registered_families, write_results

__all__ = [
    "END",
    "ESTIMATE_SLACK_BYTES",
    "LOSS_TOLERANCE",
    "POLICIES",
    "START",
    "VOCAB",
    "FamilyRun",
    "_layers",
    "broken_row",
    "default_config",
    "family_row",
    "main",
    "markdown",
    "non_text_reason",
    "quiet",
    "registered_families",
    "shrink",
    "tiny_config",
    "write_results",
]
