"""A policy in your own training loop (trainer/loop.py, the README's "In your own training loop"): a plain PyTorch
loop, the Hugging Face Trainer and a plain Lightning Trainer, each with dropout on, train to the same losses and
weights under a policy as under `none`; `check_policy` compares on the user's model and can fail; `estimate_policy`
on fake tensors equals the same step measured."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from models.gpt import GPT, GPTConfig
from trainer.loop import apply_policy, check_policy, estimate_policy, loop_step, remove_policy

V, T, B, STEPS = 64, 16, 2, 3


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=4, n_head=2, n_embd=32, dropout=0.1))


def batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)) for _ in range(n)]


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    idx, tgt = batch
    _, loss = model(idx, tgt)  # nanoGPT's (logits, loss)
    return loss


def plain_loop(model: torch.nn.Module) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    losses = []
    for s, batch in enumerate(batches()):
        torch.manual_seed(100 + s)
        losses.append(float(loop_step(model, opt, batch, loss_fn)))
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


PLAN = {"name": "per_block", "blocks": ["full", "none", "op_sac", "none"]}


@pytest.mark.parametrize("policy", ["full", "op_sac", "sqrt", PLAN], ids=["full", "op_sac", "sqrt", "plan"])
def test_a_plain_pytorch_loop_trains_as_under_none(policy: Any) -> None:
    want_losses, want = plain_loop(gpt())
    model = gpt()
    apply_policy(model, policy)
    losses, got = plain_loop(model)
    assert losses == want_losses
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    remove_policy(model)
    assert not hasattr(model, "activation_plan")


def test_check_policy_compares_on_the_users_model_and_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    model = gpt()
    weights = copy.deepcopy(model.state_dict())
    result = check_policy(model, "full", batches(), loss_fn)
    assert result.equal and result.exact and len(result.losses) == STEPS and result.plan == "[0-3]:full"
    assert sum(d.params for d in result.groups.values()) == len(list(model.parameters()))
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())  # the user's model is untouched
    # recompute without the RNG state: dropout draws other masks in the replay, and the check says where
    from torch.utils import checkpoint as ckpt

    real = ckpt.checkpoint
    monkeypatch.setattr(
        "trainer.policies.base.checkpoint", lambda fn, *a, **kw: real(fn, *a, **{**kw, "preserve_rng_state": False})
    )
    broken = check_policy(model, "full", batches(), loss_fn)
    assert not broken.equal and broken.first_failure and "at step 0" in broken.first_failure


@pytest.mark.parametrize("policy", ["none", "full", "op_sac", "selective"])
def test_estimate_policy_equals_the_same_step_measured(policy: str) -> None:
    batch = batches(1)[0]
    est = estimate_policy(gpt, policy, batch, loss_fn)
    run = estimate_policy(gpt, policy, batch, loss_fn, fake=False)
    assert (est.activation_bytes, est.peak_bytes) == (run.activation_bytes, run.peak_bytes)
    assert est.plan == run.plan and est.notes and not run.notes


def test_estimate_policy_orders_the_policies() -> None:
    batch = batches(1)[0]
    act = {p: estimate_policy(gpt, p, batch, loss_fn).activation_bytes for p in ("none", "op_sac", "full")}
    assert act["none"] > act["op_sac"] > act["full"]


class LitGPT(L.LightningModule):
    """A user's own LightningModule around a model with a policy applied: nothing of ours but apply_policy."""

    def __init__(self, policy: str) -> None:
        super().__init__()
        self.model = gpt()
        apply_policy(self.model, policy)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = loss_fn(self.model, batch)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def lightning_run(policy: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    L.seed_everything(0, verbose=False)
    module = LitGPT(policy)
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    idx, tgt = (torch.cat(t) for t in zip(*batches(), strict=True))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(idx, tgt), batch_size=B)  # the same batches
    trainer.fit(module, train_dataloaders=loader)
    return module.losses, {k: v.clone() for k, v in module.model.state_dict().items()}


def test_a_plain_lightning_trainer_trains_as_under_none() -> None:
    want_losses, want = lightning_run("none")
    losses, got = lightning_run("full")
    assert len(losses) == STEPS and losses == want_losses
    assert all(torch.equal(got[k], want[k]) for k in want)


def hf_run(
    folder: Path, policy: str, out: Path, attention: str = "sdpa", cached: list[bool] | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`cached`: whether each training forward returned a KV cache, appended per forward."""
    import transformers

    transformers.set_seed(0)
    config = transformers.AutoConfig.from_pretrained(folder)
    config.use_cache = True  # transformers' default, which the HF Trainer leaves as it is
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    apply_policy(model, policy)
    if cached is not None:
        model.register_forward_hook(lambda m, a, out: cached.append(getattr(out, "past_key_values", None) is not None))
    data = [{"input_ids": row, "labels": row} for idx, _ in batches(STEPS) for row in idx]  # B rows a step
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=B,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert model.activation_plan.describe() == f"[0-{model.config.num_hidden_layers - 1}]:{policy}"  # still installed
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def test_the_hugging_face_trainer_trains_as_under_none(hf_models: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    want_losses, want = hf_run(hf_models["llama"], "none", tmp_path / "none")
    losses, got = hf_run(hf_models["llama"], "full", tmp_path / "full")
    assert len(losses) == STEPS and losses == want_losses
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_hugging_face_trainer_runs_recompute_without_the_kv_cache(
    hf_models: dict[str, Path], tmp_path: Path, attention: str
) -> None:
    """With use_cache=True (transformers' default) a recomputed layer appended its keys and values to the cache a
    second time: under eager attention the first backward failed (a size mismatch), under SDPA the cache held every
    layer's keys and values through the step. A recomputing policy turns the cache off in training forwards."""
    pytest.importorskip("transformers")
    want_losses, want = hf_run(hf_models["llama"], "none", tmp_path / "none", attention)
    # selective recomputes the attention core where there is one (eager); under SDPA it runs as none
    for policy in ("full", "op_sac", *(["selective"] if attention == "eager" else [])):
        cached: list[bool] = []
        losses, got = hf_run(hf_models["llama"], policy, tmp_path / policy, attention, cached)
        assert cached and not any(cached), policy
        assert losses == pytest.approx(want_losses, rel=1e-5), policy
        assert all(torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-6) for k in want), policy


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_recomputed_hugging_face_model_in_your_own_loop_drops_its_kv_cache(attention: str) -> None:
    """`model(input_ids=x, labels=x)` on a LlamaForCausalLM whose config keeps transformers' default use_cache=True:
    under eager attention the first backward failed (the recompute appended the layer's keys and values to the cache
    again: a size mismatch), under SDPA the cache held every layer's keys and values through the step. In training
    the cache is off under a recomputing policy, and gradients equal none's; eval keeps it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=True,
    )
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = {}
    for policy in ("none", "full", "op_sac"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=attention).train()
        apply_policy(model, policy)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        if policy != "none":
            assert out.past_key_values is None, policy
        grads[policy] = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            assert model.eval()(input_ids=x).past_key_values is not None  # eval and generation keep the cache
    for policy in ("full", "op_sac"):
        assert all(torch.equal(grads[policy][n], g) for n, g in grads["none"].items()), policy
