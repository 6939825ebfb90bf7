"""Memory and FLOPs of a training configuration under every policy, before any GPU hour: the real model, run on
fake tensors.

    python -m trainer.estimate model=llama2-7b batch_size=8 seq_len=4096 policy=full --budget 80GB
    python -m trainer.estimate model=llama3-8b seq_len=8192 loss=chunked --json est.json
    python -m trainer.estimate policy=selective --device cuda

The same Hydra overrides as train.py compose the same config. The estimator builds the LightningModule exactly as a
run does (the model of any family, the policy installed through the decoder contract, the loss head, AdamW and its
schedule, the precision plugin's module conversion) inside `torch._subclasses.fake_tensor.FakeTensorMode`, so no
weight or activation is ever allocated, and runs one steady-state optimizer step as Lightning runs
it (`trainer.core.step.bare_step`: forward in Lightning's own precision context with last step's gradients alive,
zero_grad, backward, the numeric guard's norm, clipping, AdamW, the LR step) under the same `StepMeter` the measuring
callback uses. The two figures are therefore the two a run logs: `activation_bytes` = memory/activation_peak_mib and
`peak_bytes` = memory/peak_total_mib. FLOPs come from torch's FlopCounterMode over the same step.

Inside: `session` (the module on fake tensors, stepped once, and `measure`), `tables` (every policy and loss head),
`config_plan` (a configuration's plan, for a policy planned before it runs), `pipeline` (one pipeline rank's step:
a library call, not yet in the command) and `cli` (this command).
"""

from trainer.estimate.cli import main, parse_bytes, render, to_json
from trainer.estimate.config_plan import compiled_plans, plan_for_config, plan_result_for_config, planner_plan
from trainer.estimate.session import (
    CudaKernelRules,
    Estimate,
    Session,
    estimate,
    estimate_device,
    measure,
    open_session,
)
from trainer.estimate.tables import default_policy, estimate_all, estimate_tables

__all__ = [
    "CudaKernelRules",
    "Estimate",
    "Session",
    "default_policy",
    "estimate",
    "estimate_all",
    "estimate_device",
    "estimate_tables",
    "main",
    "measure",
    "open_session",
    "parse_bytes",
    "plan_for_config",
    "plan_result_for_config",
    "compiled_plans",
    "planner_plan",
    "render",
    "to_json",
]
