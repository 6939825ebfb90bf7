"""The live-tensor tracker, held to byte-exact hand arithmetic on tiny fp32 models (CPU, deterministic).

Sizes used throughout: fp32 = 4 bytes; a (32, 64) tensor is 8 KiB, a (32, 256) tensor 32 KiB.
Every figure counts only storages created inside the tracker's window: parameters and inputs made
before it are free. ``loss.backward()`` creates its grad seed (``ones_like(loss)``, 4 bytes) in Python
and keeps it until backward returns, so a scalar loss costs 4 + 4 bytes through the whole backward.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from trainer.measure.memory.tracker import (
    MIB,
    LiveTensorTracker,
    TimelinePoint,
    cuda_memory_counters,
    reset_cuda_peaks,
)

F32 = 4
B, D, H = 32, 64, 256  # batch, model width, hidden width
SCALAR_LOSS_AND_SEED = 2 * F32


def test_single_allocation_live_and_peak() -> None:
    with LiveTensorTracker() as t:
        x = torch.empty(1000, dtype=torch.float32)
        assert t.live_bytes == x.nbytes == 4000
        assert t.peak_bytes == 4000
        del x
        assert t.live_bytes == 0
    assert t.peak_bytes == 4000


def test_views_and_in_place_ops_are_not_double_counted() -> None:
    with LiveTensorTracker() as t:
        x = torch.zeros(10, 10)
        v = x[2:5].view(-1)
        w = x.t()[1:3]
        x.add_(1.0)
        x.mul_(2.0)
        y = x.detach()
        v.relu_()
        assert t.live_bytes == t.peak_bytes == 400
        del x, y, w
        # the view keeps the whole storage alive
        assert t.live_bytes == 400
        del v
        assert t.live_bytes == 0


def test_storages_from_before_the_window_are_not_counted() -> None:
    before = torch.ones(100)
    with LiveTensorTracker() as t:
        view = before[:10]
        before.add_(1.0)
        fresh = before * 2
    assert t.peak_bytes == fresh.nbytes == 400
    del view


def test_out_variant_resize_is_counted() -> None:
    a, b = torch.ones(4, 4), torch.ones(4, 4)
    with LiveTensorTracker() as t:
        out = torch.empty(0)
        torch.mm(a, b, out=out)  # resizes out's storage in place from 0 to 64 bytes
        assert t.live_bytes == out.nbytes == 64
        del out
        assert t.live_bytes == 0


def test_device_filter_skips_other_devices() -> None:
    x = torch.randn(8, 8)
    with LiveTensorTracker(device="cuda") as t:
        y = x * 2
    assert t.peak_bytes == 0
    del y


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))


def _mlp_step(device: str) -> tuple[LiveTensorTracker, nn.Sequential]:
    with torch.device(device):
        model = _mlp()
        x = torch.randn(B, D)  # no grad: the first Linear's backward computes no input grad
    with LiveTensorTracker(record_timeline=True) as t:
        out = model(x)
        loss = out.sum()
        loss.backward()
    del out, loss
    return t, model


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_mlp_forward_backward_peaks_match_hand_arithmetic(device: str) -> None:
    # Meta tensors all have data_ptr 0 but distinct storages: same figures without computing anything.
    t, model = _mlp_step(device)
    act_bh, act_bd = B * H * F32, B * D * F32  # 32768, 8192
    grad_w1 = grad_w2 = D * H * F32  # 65536 each
    grad_b1, grad_b2 = H * F32, D * F32  # 1024, 256
    # Forward: h1 = addmm (32 KiB) and a1 = relu(h1) (32 KiB) are both alive until Sequential drops h1
    # (relu saves its output); then out (8 KiB) and the loss: forward peak 2*32768 = 65536.
    # Backward, last layer: grad_a1 = mm (32 KiB), grad_W2 (64 KiB), grad_b2; a1 is still saved by
    # ReluBackward. threshold_backward adds grad_h1 (32 KiB) while a1 and grad_a1 are alive:
    #   activations: out + loss/seed + a1 + grad_a1 + grad_h1 = 8192 + 8 + 3*32768 = 106504
    # Then a1 and grad_a1 are freed and the first layer adds grad_W1 and grad_b1 while grad_h1 lives:
    #   total: out + loss/seed + grad_h1 + all four grads = 8192 + 8 + 32768 + 132352 = 173320
    expected_act_peak = act_bd + SCALAR_LOSS_AND_SEED + 3 * act_bh
    all_grads = grad_w1 + grad_b1 + grad_w2 + grad_b2
    expected_peak = act_bd + SCALAR_LOSS_AND_SEED + act_bh + all_grads
    assert expected_act_peak == 106504 and expected_peak == 173320
    assert t.peak_bytes == expected_peak
    assert t.peak_bytes_excluding([p.grad for p in model.parameters()]) == expected_act_peak
    forward = [p.live_bytes for p in t.timeline if p.phase == "forward"]
    assert max(forward) == 2 * act_bh
    # out and loss were deleted, the seed died with backward: only the .grad buffers remain.
    assert t.live_bytes == all_grads
    for p in model.parameters():
        p.grad = None
    assert t.live_bytes == 0


def test_peak_excluding_ignores_tensors_not_created_in_window() -> None:
    outside = torch.ones(1000)
    with LiveTensorTracker() as t:
        y = outside + 1
    assert t.peak_bytes_excluding([outside]) == t.peak_bytes == 4000
    assert t.peak_bytes_excluding([y]) == 0
    assert t.peak_bytes_excluding([None, y]) == 0  # a frozen parameter's .grad


def _blocks(n: int) -> nn.ModuleList:
    # GELU saves its input and the second mm saves GELU's output, so without checkpointing a block keeps
    # two (B, H) tensors; saving only the mm outputs (SAC) keeps one and recomputes GELU.
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(D, H, bias=False), nn.GELU(), nn.Linear(H, D, bias=False)) for _ in range(n)
    )


def _sac_context() -> object:
    return create_selective_checkpoint_contexts([torch.ops.aten.mm.default])


def _run_stack(policy: str, n_layers: int = 4) -> tuple[LiveTensorTracker, int, int]:
    """Returns the tracker, its activation peak (excluding every .grad) and what a saved_tensors_hooks
    pair around the same step would have counted as saved activations."""
    blocks = _blocks(n_layers)
    x = torch.randn(B, D, requires_grad=True)
    param_storages = {p.untyped_storage()._cdata for p in blocks.parameters()}
    packed: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s._cdata not in param_storages and t is not x:
            packed[s._cdata] = s.nbytes()
        return t

    wrap: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    if policy == "none":
        wrap = lambda b, h: b(h)  # noqa: E731
    elif policy == "full":
        wrap = lambda b, h: checkpoint(b, h, use_reentrant=False)  # noqa: E731
    else:
        wrap = lambda b, h: checkpoint(b, h, use_reentrant=False, context_fn=_sac_context)  # noqa: E731

    with LiveTensorTracker(record_timeline=True) as t:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = x
            for block in blocks:
                h = wrap(block, h)
            loss = h.sum()
            loss.backward()
    act_peak = t.peak_bytes_excluding([p.grad for p in blocks.parameters()] + [x.grad])
    return t, act_peak, sum(packed.values())


def test_checkpoint_and_sac_peaks_match_hand_arithmetic() -> None:
    n = 4
    act_bh, act_bd = B * H * F32, B * D * F32
    t_none, none, _ = _run_stack("none", n)
    t_full, full, hooks_full = _run_stack("full", n)
    t_sac, sac, hooks_sac = _run_stack("sac", n)

    # No checkpoint: every block keeps mm1's output (saved by GELU), GELU's output (saved by mm2) and its
    # output (the next block's input; the last one is `h`). Backward of the last block adds grad_a
    # (32 KiB) before anything is freed: n*(8192 + 2*32768) + 8 + 32768 = 327688.
    assert none == n * (act_bd + 2 * act_bh) + SCALAR_LOSS_AND_SEED + act_bh == 327688
    # Full checkpoint: only block outputs survive forward. The last block's recompute brings back mm1's
    # and GELU's outputs, and its backward adds grad_a: n*8192 + 8 + 3*32768 = 131080.
    assert full == n * act_bd + SCALAR_LOSS_AND_SEED + 3 * act_bh == 131080
    # SAC saving mm: each block caches mm1's output (mm2's output is the block output, already counted);
    # backward recomputes GELU's output and adds grad_a: n*(8192 + 32768) + 8 + 2*32768 = 229384.
    assert sac == n * (act_bd + act_bh) + SCALAR_LOSS_AND_SEED + 2 * act_bh == 229384
    assert full < sac < none

    # saved_tensors_hooks only see what checkpoint saves outside its regions: the block inputs (here the
    # n-1 not counting x). They cannot tell SAC from full, and they miss the recompute the tracker sees.
    assert hooks_full == hooks_sac == (n - 1) * act_bd
    assert full > hooks_full
    recomputed = {p.op_name for p in t_full.timeline if p.phase == "backward"}
    assert "aten.gelu.default" in recomputed and "aten.gelu.default" in {
        p.op_name for p in t_sac.timeline if p.phase == "backward"
    }
    assert "aten.gelu.default" not in {p.op_name for p in t_none.timeline if p.phase == "backward"}
    # SAC replays the cached mm outputs instead of rerunning them. Full recompute reruns only the first
    # mm of each block: non-reentrant checkpoint stops recomputing once the last saved tensor is back,
    # and mm2's inputs are saved before mm2 runs.
    mm_bwd = {
        name: sum(p.op_name == "aten.mm.default" and p.phase == "backward" for p in tr.timeline)
        for name, tr in (("none", t_none), ("full", t_full), ("sac", t_sac))
    }
    assert mm_bwd["sac"] == mm_bwd["none"] and mm_bwd["full"] == mm_bwd["none"] + n


def test_timeline_phases_and_files(tmp_path) -> None:
    t, _ = _mlp_step("cpu")
    phases = [p.phase for p in t.timeline]
    assert set(phases) == {"forward", "backward"}
    first_backward = phases.index("backward")
    assert all(p == "forward" for p in phases[:first_backward])
    assert all(p == "backward" for p in phases[first_backward:])
    assert [p.op_index for p in t.timeline] == list(range(len(t.timeline)))
    assert all(isinstance(p, TimelinePoint) for p in t.timeline)
    assert max(p.live_bytes for p in t.timeline) == t.peak_bytes

    json_path, png_path = tmp_path / "tl" / "timeline.json", tmp_path / "tl" / "timeline.png"
    t.save_timeline(json_path, png_path)
    data = json.loads(json_path.read_text())
    assert data["peak_bytes"] == t.peak_bytes
    assert data["num_ops"] == len(data["points"]) == len(t.timeline)
    assert data["points"][0].keys() == {"op_index", "live_bytes", "phase", "op_name"}
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_enter_and_exit_from_separate_calls_and_fresh_window() -> None:
    t = LiveTensorTracker()
    t.__enter__()
    x = torch.empty(256)
    t.__exit__(None, None, None)
    assert t.peak_bytes == 1024
    t.__enter__()  # a new window: last window's x is not in it and its free must not count here
    y = torch.empty(64)
    del x
    t.__exit__(None, None, None)
    assert t.live_bytes == t.peak_bytes == 256
    del y
    assert t.live_bytes == 0


def test_storage_resize_is_tracked_only_while_a_tracker_is_active() -> None:
    """FSDP2 frees and refills its unsharded parameters with UntypedStorage.resize_, which no dispatch mode sees: the
    tracker wraps torch's method while it is active (and counts the resize), and gives torch's own back on exit."""
    torchs = torch.UntypedStorage.resize_
    storage = torch.empty(0).untyped_storage()  # empty, as FSDP2 leaves an unsharded parameter between uses
    outer, inner = LiveTensorTracker(), LiveTensorTracker()
    with outer:
        assert torch.UntypedStorage.resize_ is not torchs
        with inner:
            storage.resize_(1024)
        assert inner.peak_bytes == inner.live_bytes == 1024
        assert torch.UntypedStorage.resize_ is not torchs  # the outer tracker is still active
        storage.resize_(0)
    assert torch.UntypedStorage.resize_ is torchs
    assert outer.peak_bytes == 1024 and outer.live_bytes == 0
    storage.resize_(512)  # outside any window: nothing counts it
    assert outer.live_bytes == 0


def test_exit_with_another_mode_on_top_is_refused() -> None:
    outer = LiveTensorTracker()
    inner = LiveTensorTracker()
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="innermost dispatch mode"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)


def test_cuda_counters_empty_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by the gpu test")
    assert cuda_memory_counters() == {}
    reset_cuda_peaks()  # must be a harmless no-op


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_counters_and_tracker_on_cuda() -> None:
    torch.cuda.synchronize()
    reset_cuda_peaks()
    base = torch.cuda.memory_allocated()
    with LiveTensorTracker(device="cuda") as t:
        x = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
        y = torch.empty(2 * MIB, dtype=torch.uint8, device="cpu")  # filtered out by device
        del x
    torch.cuda.synchronize()
    counters = cuda_memory_counters()
    assert set(counters) == {"peak_allocated_mib", "peak_reserved_mib", "alloc_retries", "num_ooms"}
    assert t.peak_bytes == 4 * MIB and t.live_bytes == 0
    assert counters["peak_allocated_mib"] >= (base + 4 * MIB) / MIB
    assert counters["peak_reserved_mib"] >= counters["peak_allocated_mib"]
    assert counters["num_ooms"] == 0
    del y

    # The tracker and the allocator agree on an MLP step.
    model = _mlp().cuda()
    xin = torch.randn(B, D, device="cuda")
    # One step first, so the cuBLAS workspace and the .grad buffers exist before the measured step.
    model(xin).sum().backward()
    torch.cuda.synchronize()
    reset_cuda_peaks()
    base = torch.cuda.memory_allocated()
    with LiveTensorTracker(device="cuda") as t:
        model(xin).sum().backward()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    # The allocator rounds each of the few live tensors up to a 512-byte block.
    assert t.peak_bytes <= measured <= t.peak_bytes + 16 * 512


def test_adopted_storages_count_until_freed_and_marks_bound_the_replay() -> None:
    weights = torch.zeros(1024)  # 4 KiB that exist before the window, e.g. last step's gradients
    with LiveTensorTracker() as t:
        assert t.adopt([weights, weights.view(32, 32), None]) == 4096  # a view is the same storage
        act = torch.zeros(2048)  # 8 KiB made by the step
        del weights  # freed inside the window: it leaves live_bytes
        assert t.live_bytes == 8192
        end_of_backward = t.mark()
        later = torch.zeros(4096)  # 16 KiB after the mark, e.g. the optimizer's temporaries
        del later
    assert t.peak_bytes == max(4096 + 8192, 8192 + 16384)
    assert t.peak_bytes_excluding([]) == 8192 + 16384  # adopted storages are never activations
    assert t.peak_bytes_excluding([], until=end_of_backward) == 8192
    del act


# ---- CUDA's caching allocator, replayed ---------------------------------------------------------------------------


def test_the_allocator_model_rounds_pools_and_segments_as_torchs() -> None:
    from trainer.measure.memory.caching_allocator import CachingAllocator

    a = CachingAllocator()
    small = a.malloc(100)  # rounded to 512 bytes, in a fresh 2 MiB small-pool segment
    assert (a.allocated, a.reserved) == (512, 2 * MIB)
    a.malloc(5 * MIB)  # a large request under 10 MiB: a 20 MiB segment
    assert a.reserved == 22 * MIB
    big = a.malloc(30 * 10**6)  # ≥ 10 MiB: its own segment, rounded up to 2 MiB (28.6 → 30 MiB)
    assert a.reserved == 52 * MIB and a.segments == 3
    a.free(big)
    a.malloc(10 * MIB)  # best fit: the freed 30 MiB block, split (the 20 MiB rest stays cached)
    assert a.reserved == 52 * MIB
    a.free(small)
    a.malloc(1000)  # the small pool's own free block, never a large one
    assert a.reserved == 52 * MIB


def test_the_allocator_model_fragments_and_merges() -> None:
    from trainer.measure.memory.caching_allocator import CachingAllocator

    a = CachingAllocator()
    x = a.malloc(100 * MIB)
    a.malloc(100 * MIB)
    a.free(x)
    a.malloc(150 * MIB)  # neither freed 100 MiB block holds it: a third segment, reserved above what is live
    assert (a.allocated, a.reserved) == (250 * MIB, 350 * MIB)
    b = CachingAllocator()
    b.free(b.malloc(100 * MIB))
    q, r = b.malloc(30 * MIB), b.malloc(30 * MIB)  # both cut from that one segment: 30 | 30 | 40 free
    assert b.segments == 1
    b.free(q)
    b.free(r)  # merged with each other and the free rest: one 100 MiB block again
    b.malloc(90 * MIB)
    assert b.reserved == 100 * MIB and b.segments == 1


def _peak_reserved(alloc: Any, ops: list[tuple[str, int, int]]) -> int:
    """Run ("m", name, bytes) / ("f", name, 0) through an allocator model; its reserved peak."""
    live = {}
    for op, name, nbytes in ops:
        if op == "m":
            live[name] = alloc.malloc(nbytes)
        else:
            alloc.free(live.pop(name))
    return alloc.peak_reserved


# Sequences whose reserved peak is derived by hand from c10/cuda/CUDACachingAllocator.cpp (v2.6.0 line numbers;
# the expandable rules are the same in later releases): (why, ops, default mode's peak, expandable segments' peak).
EXPANDABLE_CASES = [
    (
        # both: one 20 MiB segment / page (a 3 MiB request is large, under 10 MiB: kLargeBuffer, L2550-2558;
        # expandable: one 20 MiB page, L2272, L2295-2361); the freed 3 MiB cannot hold 5 MiB, the 14 MiB rest can
        "reuse within one segment",
        [("m", 1, 3 * MIB), ("m", 2, 3 * MIB), ("f", 1, 0), ("m", 3, 5 * MIB)],
        20 * MIB,
        20 * MIB,
    ),
    (
        # 1.5 MiB is a large request (> kSmallSize 1 MiB), 0.6 MiB a small one: a 20 MiB and a 2 MiB segment, or
        # one page of each pool's expandable segment (2 MiB pages for the small pool, L2272)
        "two pools",
        [("m", 1, 3 * MIB // 2), ("m", 2, 6 * MIB // 10)],
        22 * MIB,
        22 * MIB,
    ),
    (
        # default: three 12 MiB segments (≥ 10 MiB: rounded to 2 MiB, L2550-2558), never merged across segments,
        # so three new 14 MiB ones: 78 MiB. Expandable: the pages are one address range, so the frees merge into
        # one 40 MiB block (L2474-2505) that the 13 MiB requests split (any rest ≥ 512 B, L2540-2548): 40 MiB
        "segments merge only when expandable",
        [("m", i, 12 * MIB) for i in (1, 2, 3)]
        + [("f", i, 0) for i in (1, 2, 3)]
        + [("m", i, 13 * MIB) for i in (4, 5, 6)],
        78 * MIB,
        40 * MIB,
    ),
    (
        # default: a 22 MiB segment (rounded to 2 MiB); expandable: whole 20 MiB pages, two of them
        "whole pages",
        [("m", 1, 22 * MIB)],
        22 * MIB,
        40 * MIB,
    ),
    (
        # expandable: A [0,10) B [10,14) free [14,20) in one page; A freed. 6 MiB fits both free blocks; the one
        # below the unmapped rest counts as itself plus that rest (get_free_block L2570-2588), so A's is cut
        # (best fit alone would take [14,20)). The 24 MiB request then grows the free [14,20) by one page
        # (try_allocate_expandable_block L2363-2394): 40 MiB, where taking [14,20) first would have needed two.
        # Default: a 10 MiB segment, a 20 MiB one for B (its 16 MiB rest split), C in A's, a 24 MiB one for D.
        "the block below the unmapped rest is taken last",
        [("m", "A", 10 * MIB), ("m", "B", 4 * MIB), ("f", "A", 0), ("m", "C", 6 * MIB), ("m", "D", 24 * MIB)],
        54 * MIB,
        40 * MIB,
    ),
]


@pytest.mark.parametrize("why, ops, default, expandable", EXPANDABLE_CASES, ids=[c[0] for c in EXPANDABLE_CASES])
def test_expandable_segments_reserve_what_torchs_rules_give(why: str, ops: Any, default: int, expandable: int) -> None:
    from trainer.measure.memory.caching_allocator import CachingAllocator, ExpandableSegments

    assert _peak_reserved(CachingAllocator(), ops) == default, why
    assert _peak_reserved(ExpandableSegments(), ops) == expandable, why


def test_the_allocator_setting_is_read_as_torch_reads_it() -> None:
    from trainer.measure.memory.caching_allocator import AllocatorConf

    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert AllocatorConf.from_env(env).expandable_segments  # the CUDA variable wins
    assert not AllocatorConf.from_env({}).expandable_segments
    conf = AllocatorConf.parse(
        "max_split_size_mb:128, roundup_power2_divisions:[256:1,512:2,>:4],expandable_segments:True"
    )
    assert conf.expandable_segments and conf.unmodelled == (
        "max_split_size_mb:128",
        "roundup_power2_divisions:[256:1,512:2,>:4]",
    )
    for bad, says in (("expandable_segments:true", "True or False"), ("expandable:True", "not one of torch's")):
        with pytest.raises(ValueError, match=says):
            AllocatorConf.parse(bad)
    # torch's keys that change nothing the device reserves are accepted; an empty CUDA variable still wins
    assert AllocatorConf.parse("pinned_use_background_threads:True,expandable_segments:True").unmodelled == ()
    assert not AllocatorConf.from_env(
        {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    ).expandable_segments
    # from the environment, what torch would refuse is one line naming the variable
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="PYTORCH_ALLOC_CONF='expandable_segments:yes'"):
        AllocatorConf.from_env({"PYTORCH_ALLOC_CONF": "expandable_segments:yes"})


def test_a_replayed_step_reuses_last_steps_blocks() -> None:
    """Replayed twice, a step whose gradients replace last step's reserves what one step needs, not two."""
    from trainer.measure.memory.caching_allocator import replay

    params, grad_old = 0, 1
    events = [(params, 100 * MIB), (grad_old, 100 * MIB)]  # adopted: the state before the step
    events += [(grad_old, -100 * MIB)]  # zero_grad
    events += [(2, 300 * MIB), (3, 100 * MIB), (2, -300 * MIB)]  # activations, the new gradient, activations freed
    figures = replay(events, adopted={params, grad_old})
    assert figures.peak_allocated == 500 * MIB  # parameters + activations + the new gradient
    assert figures.peak_reserved == 500 * MIB  # the old gradient's block held the new one: no fourth segment


ALLOCATOR_DRIVER = """
import json, sys, torch
ops = json.loads(sys.argv[1])
torch.cuda.init()
start, live = torch.cuda.memory_reserved(), {}
for op, name, nbytes in ops:
    if op == "m":
        live[name] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    else:
        del live[name]
print(torch.cuda.max_memory_reserved() - start)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: compares the model with torch's allocator")
@pytest.mark.parametrize("why, ops, default, expandable", EXPANDABLE_CASES, ids=[c[0] for c in EXPANDABLE_CASES])
def test_torchs_allocator_reserves_what_the_hand_derived_cases_say(
    why: str, ops: Any, default: int, expandable: int
) -> None:
    """The sequences whose answers were derived from torch's source, run through torch's own allocator in a fresh
    process per setting (it reads PYTORCH_CUDA_ALLOC_CONF once): the same reserved peaks."""
    import os
    import subprocess
    import sys

    for setting, want in (("expandable_segments:False", default), ("expandable_segments:True", expandable)):
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": setting}
        r = subprocess.run(
            [sys.executable, "-c", ALLOCATOR_DRIVER, json.dumps(ops)], env=env, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr[-2000:]
        assert int(r.stdout.split()[-1]) == want, (why, setting)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: compares the model with torch's allocator")
def test_the_allocator_model_reserves_what_torchs_reserves() -> None:
    """The same allocation sequence on this GPU and in the model: the same reserved and allocated peaks."""
    from trainer.measure.memory.caching_allocator import CachingAllocator

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base_reserved, base_alloc = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    assert base_alloc == 0 or base_reserved >= base_alloc
    sizes = [100, 5 * MIB, 30 * 10**6, 100 * MIB, 7 * MIB, 3 * MIB, 300 * MIB, 1000, 2 * MIB + 1]
    model, live, mine = CachingAllocator(), {}, {}
    torch.cuda.empty_cache()
    start = torch.cuda.memory_reserved()
    for i, n in enumerate(sizes * 3):
        live[i] = torch.empty(n, dtype=torch.uint8, device="cuda")
        mine[i] = model.malloc(n)
        if i % 3 == 2:  # free every third one's predecessor
            del live[i - 1]
            model.free(mine.pop(i - 1))
    assert torch.cuda.max_memory_reserved() - start == model.peak_reserved
