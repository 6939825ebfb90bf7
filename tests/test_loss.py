"""The loss heads: chunked and fused give standard's loss and gradients (ignored tokens, tied and untied heads,
fp32 and bf16 autocast), and chunked never holds an N×V tensor."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch

from models import FAMILIES, build_model
from models.adapter import adapter_for
from tests.conftest import NATIVE_FAMILIES
from trainer.core.schema import compose_config
from trainer.loss import LossConfig, head_loss
from trainer.measure.memory.tracker import LiveTensorTracker

V, T, B = 1000, 24, 3
# fp32: the heads sum the same per-token losses in another order: ≤ 1e-6 relative. bf16 autocast: the head weight's
# gradient is summed from bf16 chunk products instead of one bf16 product (a few bf16 ulps apart), so each gradient
# is held within 2 % of its own largest element (elementwise relative error is meaningless near zero at 8 bits).
FP32 = dict(rtol=1e-6, atol=1e-7)
BF16_OF_LARGEST = 2e-2


def assert_close(got: torch.Tensor, want: torch.Tensor, precision: str, what: str) -> None:
    if precision == "32-true":
        torch.testing.assert_close(got, want, **FP32, msg=lambda m: f"{what}: {m}")
        return
    scale = want.abs().max().item() or 1.0
    err = (got - want).abs().max().item()
    assert err <= BF16_OF_LARGEST * scale, f"{what}: max |Δ| {err:.3g} > 2% of its largest element {scale:.3g}"


def model(family: str, tied: bool) -> Any:
    """The family at its test size (the registry's), one layer, no dropout, this vocabulary and length."""
    return copy.deepcopy(_model(family, tied))


@functools.cache
def _model(family: str, tied: bool) -> Any:
    shrink = [
        "model.n_layer=1",
        "model.dropout=0.0",
        f"model.vocab_size={V}",
        f"model.block_size={T}",
        f"model.tie_embeddings={tied}",
    ]
    config = compose_config([*FAMILIES[family].tiny_overrides, *shrink, f"seq_len={T}"])
    torch.manual_seed(0)
    return build_model(config.model)


def batch(ignored: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    idx, tgt = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    if ignored:  # padding at the end of two rows, and a stray ignored token
        tgt[0, -7:] = -100
        tgt[2, -3:] = -100
        tgt[1, 4] = -100
    return idx, tgt


def loss_and_grads(m: Any, cfg: LossConfig, precision: str, ignored: bool) -> tuple[torch.Tensor, dict[str, Any]]:
    m = copy.deepcopy(m)
    a = adapter_for(m)
    idx, tgt = batch(ignored)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss = head_loss(a.hidden(idx), a.head, tgt, cfg)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.parametrize("ignored", [False, True], ids=["no-ignore", "ignore_index"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", NATIVE_FAMILIES)
@pytest.mark.parametrize("name, chunk", [("chunked", 16), ("chunked", 50), ("fused", 16)])
def test_chunked_and_fused_equal_standard(
    family: str, tied: bool, precision: str, ignored: bool, name: str, chunk: int
) -> None:
    m = model(family, tied)
    want_loss, want = loss_and_grads(m, LossConfig("standard"), precision, ignored)
    got_loss, got = loss_and_grads(m, LossConfig(name, chunk_tokens=chunk), precision, ignored)
    assert got_loss.dtype == want_loss.dtype == torch.float32
    assert_close(got_loss, want_loss, precision, "loss")
    for n in want:
        assert_close(got[n], want[n], precision, n)


def test_ignored_tokens_are_left_out_of_the_mean() -> None:
    m = model("gpt", True)
    a = adapter_for(m)
    idx, tgt = batch(ignored=True)
    keep = tgt != -100
    with torch.no_grad():
        logits = a.head(a.hidden(idx))
        per_token = torch.nn.functional.cross_entropy(logits[keep].float(), tgt[keep], reduction="none")
        for name in ("standard", "chunked", "fused"):
            got = head_loss(a.hidden(idx), a.head, tgt, LossConfig(name, chunk_tokens=16))
            torch.testing.assert_close(got, per_token.mean(), rtol=1e-6, atol=1e-7)


def test_chunked_never_holds_the_full_logits() -> None:
    """Standard keeps the (N, V) log-softmax for backward and holds the logits and their gradients at once; chunked
    keeps only the hidden states, and in backward holds one chunk's logits, their gradients and the chunk's
    contribution to the head weight's gradient at a time."""
    m = model("gpt", False)
    a = adapter_for(m)
    g = torch.Generator().manual_seed(2)
    idx, tgt = torch.randint(0, V, (8, T), generator=g), torch.randint(0, V, (8, T), generator=g)
    h = a.hidden(idx).detach().requires_grad_(True)
    N, C, chunk = 8 * T, 32, 8
    peaks = {}
    for name in ("standard", "chunked"):
        with LiveTensorTracker() as t:
            loss = head_loss(h, a.head, tgt, LossConfig(name, chunk_tokens=chunk))
            after_forward = t.live_bytes
            loss.backward()
        peaks[name] = (after_forward, t.peak_bytes_excluding([h.grad, *(p.grad for p in m.parameters())]))
        h.grad = None
        for p in m.parameters():
            p.grad = None
    full_logits = N * V * 4
    assert peaks["standard"][0] >= full_logits  # the log-softmax it keeps
    assert peaks["chunked"][0] < full_logits / 10  # a few scalars: no logits kept
    assert peaks["standard"][1] >= 2 * full_logits
    # one chunk's logits, log-softmax and their gradients; the chunk's part of the weight's gradient and its sum;
    # the chunk's hidden gradient and the (N, C) buffer autograd scatters it into; a few scalars
    one_chunk = 4 * chunk * V * 4 + 2 * V * C * 4 + chunk * C * 4 + N * C * 4
    assert peaks["chunked"][1] <= one_chunk + 64, (peaks, one_chunk)
    assert peaks["chunked"][1] < peaks["standard"][1] / 3


def test_chunk_size_is_the_chunk() -> None:
    m = model("gpt", False)
    a = adapter_for(m)
    idx, tgt = batch(ignored=False)
    h = a.hidden(idx).detach()

    def forward_peak(chunk: int) -> int:
        with torch.no_grad(), LiveTensorTracker() as t:
            head_loss(h, a.head, tgt, LossConfig("chunked", chunk_tokens=chunk))
        return t.peak_bytes

    # logits (N_chunk, V) fp32 and the cross-entropy's log-softmax of them: twice the chunk's logits, plus scalars
    assert forward_peak(16) - forward_peak(8) == 2 * (16 - 8) * V * 4


def test_bad_loss_config_is_one_line() -> None:
    for kwargs, fragment in (({"name": "bogus"}, "loss='bogus' is unknown"), ({"chunk_tokens": 0}, "chunk_tokens=0")):
        with pytest.raises(ValueError) as e:
            LossConfig(**kwargs)  # type: ignore[arg-type]
        assert fragment in str(e.value) and "\n" not in str(e.value)
