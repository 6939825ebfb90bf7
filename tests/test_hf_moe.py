"""Mixture-of-Experts models in the estimator: transformers runs their experts as grouped matmuls
(`aten._grouped_mm`), whose fake kernel refuses fp32; within the estimate the CPU kernel's own output is made
(trainer/measure/fake/kernels.py), so an MoE model's fp32 estimate equals its run as a dense model's does
(tests/test_estimate.py). Tiny random-weight configs saved to a temp folder, no network."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_estimate import RUN, _with_policy, assert_estimate_equals_run
from trainer.core.run import train
from trainer.core.schema import ConfigError, validate
from trainer.estimate import measure, open_session
from trainer.measure.fake.kernels import cpu_kernel_rules
from trainer.policies import build_policy

transformers = pytest.importorskip("transformers")

COMMON = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "vocab_size": 320,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
FAMILIES: dict[str, Callable[[], Any]] = {
    "mixtral": lambda: transformers.MixtralConfig(
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, **COMMON
    ),
    # a shared expert beside the routed ones
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        **COMMON,
    ),
    "olmoe": lambda: transformers.OlmoeConfig(intermediate_size=64, num_experts=4, num_experts_per_tok=2, **COMMON),
}


def _folder(family: str, tmp_path: Path) -> Path:
    folder = tmp_path / family
    FAMILIES[family]().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("policy", ["none", "full"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_fp32_estimate_equals_a_training_run(
    compose_cfg: Callable[..., Any], tmp_path: Path, family: str, policy: str
) -> None:
    overrides = [
        "model=hf",
        f"model.name_or_path={_folder(family, tmp_path)}",
        "seq_len=32",
        "batch_size=2",
        "precision=32-true",
        *RUN,
    ]
    cfg = _with_policy(compose_cfg(*overrides), policy)
    session = open_session(validate(cfg))
    assert session.module.model.config._experts_implementation == "grouped_mm"  # what the run executes, too
    est = measure(session, build_policy(validate(cfg).policy))
    summary = train(cfg, tmp_path / "run")
    assert_estimate_equals_run(est, summary)


LAYOUTS = {  # (mat_a, mat_b, offs): the forward's 2D×3D (weights transposed, as Mixtral's), its backward's 2D×2D
    "2d3d": lambda: (torch.randn(12, 8), torch.randn(3, 6, 8).transpose(-2, -1), [3, 7, 12]),
    "2d2d": lambda: (torch.randn(12, 8).t(), torch.randn(6, 12).t(), [3, 7, 12]),
    "3d2d": lambda: (torch.randn(3, 4, 8), torch.randn(18, 8).t(), [6, 12, 18]),
    "3d3d": lambda: (torch.randn(3, 4, 8), torch.randn(3, 6, 8).transpose(-2, -1), None),
    "bf16": lambda: (torch.randn(12, 8).bfloat16(), torch.randn(3, 6, 8).bfloat16().transpose(-2, -1), [3, 7, 12]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_fake_grouped_mm_is_the_cpu_kernels_output(layout: str) -> None:
    """Shape, strides (the row padded to 16 bytes: 6 columns take 8) and storage bytes of the real CPU kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def run() -> tuple[Any, ...]:
        torch.manual_seed(0)
        a, b, offs = LAYOUTS[layout]()
        out = torch._grouped_mm(a, b, offs=None if offs is None else torch.tensor(offs, dtype=torch.int32))
        return tuple(out.shape), out.stride(), out.dtype, out.untyped_storage().nbytes()

    real = run()
    with FakeTensorMode(), cpu_kernel_rules():
        fake = run()
    assert fake == real


def test_a_model_that_routes_with_data_dependent_shapes_is_one_line(
    compose_cfg: Callable[..., Any], tmp_path: Path
) -> None:
    """The experts' eager path loops over the experts a batch hit (`nonzero`): no fake tensor can say which."""
    overrides = [
        "model=hf",
        f"model.name_or_path={_folder('mixtral', tmp_path)}",
        "seq_len=32",
        "batch_size=2",
        "precision=32-true",
    ]
    config = validate(compose_cfg(*overrides))
    session = open_session(config)
    session.module.model.set_experts_implementation("eager")
    with pytest.raises(ConfigError) as e:
        measure(session, build_policy(config.policy))
    line = str(e.value)
    assert "\n" not in line and "aten.nonzero" in line and "MixtralExperts.forward" in line, line
