"""The step-time model: what the trace records of each op, the roofline's arithmetic, the speeds it is costed
against, and its use by the estimator and the planner. Times are never asserted: counts, bytes and the model's own
arithmetic are."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from trainer.errors import ConfigError
from trainer.measure.gpus import Gpu, load_catalogue
from trainer.measure.time import calibration, collectives, op_trace, roofline
from trainer.measure.time.op_trace import OpKey, OpTrace, Work
from trainer.measure.time.roofline import Speed


def _trace(fn) -> Work:  # type: ignore[no-untyped-def]
    with OpTrace() as t:
        fn()
    return t.work


def _unsigned(work: Work) -> dict[OpKey, int]:
    """The ops without their signatures (what the roofline prices)."""
    return {k._replace(signature=""): n for k, n in work.ops.items()}


def test_each_op_is_classified_with_its_flops_and_bytes() -> None:
    a, b = torch.ones(8, 16), torch.ones(16, 4)
    work = _trace(lambda: a @ b)
    assert _unsigned(work) == {OpKey("matmul", "fp32", 2 * 8 * 16 * 4, (8 * 16 + 16 * 4 + 8 * 4) * 4): 1}
    x = torch.ones(1024)
    assert _unsigned(_trace(lambda: x * x)) == {OpKey("memory", "", 0, 2 * 1024 * 4): 1}  # x read once, written once
    assert set(_trace(lambda: x.view(32, 32)).ops) == {OpKey("free", "", 0, 0)}  # a view: nothing to replay
    assert {k[0] for k in _trace(lambda: torch.nn.functional.gelu(x)).ops} == {"math"}
    assert {k[0] for k in _trace(lambda: torch.nn.functional.dropout(x, 0.5, training=True)).ops} >= {"random"}
    bf = torch.ones(8, 16, dtype=torch.bfloat16)
    assert [k[:2] for k in _trace(lambda: bf @ bf.t()).ops if k[0] != "free"] == [("matmul", "bf16")]


def test_fake_tensors_give_the_same_work_as_real_ones() -> None:
    """The estimator traces fake tensors: their ops, FLOPs and bytes are the real run's."""

    def step(x: torch.Tensor, w: torch.Tensor) -> None:
        torch.nn.functional.gelu(x @ w).softmax(-1).sum().backward()

    torch.manual_seed(0)
    real = _trace(lambda: step(torch.randn(32, 64), torch.randn(64, 48, requires_grad=True)))
    with FakeTensorMode():
        fake = _trace(lambda: step(torch.randn(32, 64), torch.randn(64, 48, requires_grad=True)))
    assert real.ops == fake.ops and real.flops == fake.flops > 0


def _speed(overlapped: bool) -> Speed:
    return Speed(
        name="test",
        matmul={"fp32": ((1.0, 1e9),)},
        bandwidth={"memory": ((1.0, 1e9),)},
        op_s=1e-6,
        free_s=0.0,
        sac_s=1e-5,
        host_link=1e9,
        overlapped=overlapped,
    )


def test_the_roofline_arithmetic() -> None:
    """An op takes the longer of its FLOPs and its bytes; the host's per-op costs add up on a CPU and run ahead of the
    kernels on a GPU; offload's copies hide behind compute up to its length when prefetched."""
    work = Work()
    work.ops[OpKey("matmul", "fp32", 2_000_000, 1_000)] = 3  # 2 ms each: compute-bound
    work.ops[OpKey("memory", "", 0, 500_000)] = 2  # 0.5 ms each
    work.ops[OpKey("free", "", 0, 0)] = 5
    work.sac_decisions = 10
    cpu = _speed(False).predict(work)
    assert cpu.matmul_ms == pytest.approx(6.0) and cpu.memory_ms == pytest.approx(1.0)
    assert cpu.host_ms == pytest.approx(5 * 1e-3 + 10 * 1e-2)
    assert cpu.ms == pytest.approx(7.0 + cpu.host_ms)
    gpu = _speed(True).predict(work)
    assert gpu.ms == pytest.approx(7.0)  # the host's 0.105 ms run ahead of 7 ms of kernels
    work.host_copy_bytes = 9_000_000  # 9 ms at 1 GB/s
    assert _speed(True).predict(work).exposed_copy_ms == pytest.approx(2.0)
    work.prefetch = False
    assert _speed(True).predict(work).ms == pytest.approx(16.0)


def test_fsdp2_collectives_are_costed_on_the_gpu_link_with_the_first_and_last_exposed() -> None:
    """Ring collectives: each rank sends (W−1)/W of what is gathered or reduced. Per micro-batch every unit is
    all-gathered for the forward, the layers again for the backward, every gradient reduce-scattered; the first
    all-gather of each pass and the last reduce-scatter are exposed, the rest hides behind compute up to its
    length."""
    c = collectives.Collectives.fsdp2([100, 100, 100], 50, world=4, param_bytes=2, reduce_bytes=4, micro_batches=2)
    per_micro = (350 * 2 + 300 * 2 + 350 * 4) * 3 / 4
    assert c.sent_bytes == int(per_micro) * 2
    assert c.exposed_bytes == int(((50 + 100) * 2 + 100 * 2 + (50 + 100) * 4) * 3 / 4) * 2
    assert (
        collectives.Collectives.fsdp2([100], 50, world=1, param_bytes=2, reduce_bytes=4, micro_batches=1).sent_bytes
        == 0
    )
    # the last layer kept gathered after the forward (torchtitan's rule): not gathered again, and the backward's
    # first all-gather (the next layer's) hides behind the last layer's backward
    kept = collectives.Collectives.fsdp2([100, 100, 100], 50, 4, 2, 4, 2, resharded=[True, True, False])
    assert kept.sent_bytes == int((350 * 2 + 200 * 2 + 350 * 4) * 3 / 4) * 2
    assert kept.exposed_bytes == int(((50 + 100) * 2 + (50 + 100) * 4) * 3 / 4) * 2
    assert (kept.all_gathers, kept.reduce_scatters) == ((4 + 2) * 2, 4 * 2)
    speed = Speed("t", {"fp32": ((1.0, 1e9),)}, {"memory": ((1.0, 1e9),)}, 0.0, 0.0, 0.0, gpu_link=1e9, overlapped=True)
    work = Work()
    work.ops[OpKey("matmul", "fp32", 10_000_000, 0)] = 1  # 10 ms of compute
    work.collectives = collectives.Collectives(sent_bytes=8_000_000, exposed_bytes=1_000_000)  # 8 ms, 1 ms exposed
    t = speed.predict(work)
    assert t.collective_ms == pytest.approx(8.0) and t.exposed_collective_ms == pytest.approx(1.0)
    assert t.ms == pytest.approx(11.0)
    work.collectives = collectives.Collectives(
        sent_bytes=15_000_000, exposed_bytes=1_000_000
    )  # more than compute hides
    assert speed.predict(work).ms == pytest.approx(10.0 + 1.0 + (14.0 - 10.0))
    assert Speed("cpu", speed.matmul, speed.bandwidth, 0.0, 0.0, 0.0).predict(work).ms == pytest.approx(10.0)


def test_an_fsdp2_estimate_carries_its_collectives_in_the_dtype_they_move(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimator's FSDP2 rank: parameters all-gathered in bf16 under FSDP2's mixed-precision policy (fp32 under
    autocast over fp32 shards), gradients reduced in fp32; a fit table's GPU prices them, once: the op trace keys
    FSDP2's own c10d collectives as free, and charges the copies around them the bytes they read and write."""
    from trainer.core.schema import compose_config
    from trainer.estimate import measure, open_session
    from trainer.policies import build_policy

    seen: list[tuple[str, str]] = []  # FSDP2's own collectives (c10d ops) as the op trace keys them
    copies: list[tuple[str, int, int]] = []  # FSDP2's copies: (op, bytes charged, bytes read once + written once)

    def nbytes(tree: Any) -> int:
        return sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(tree) if torch.is_tensor(t))

    def classify(func: Any, args: Any, kwargs: Any, out: Any, flops: int) -> Any:
        key = op_trace_classify(func, args, kwargs, out, flops)
        name = func._overloadpacket.__name__
        if getattr(func, "namespace", "") == "c10d":
            seen.append((name, key.kind))
        elif name == "all_gather_copy_in":  # its shards into this rank's slice (out[0]) of the buffer handed in
            copies.append((name, key.nbytes, nbytes(args[0]) + nbytes(out[0])))
        elif name in ("split_with_sizes_copy", "chunk_cat"):  # sources read, the out= tensors written
            copies.append((name, key.nbytes, nbytes(args[0]) + nbytes(kwargs["out"])))
        elif name == "_foreach_copy_":  # sources (args[1]) read, destinations overwritten
            copies.append((name, key.nbytes, nbytes(args[1]) + nbytes(args[0])))
        return key

    op_trace_classify = op_trace.classify
    monkeypatch.setattr(op_trace, "classify", classify)
    sent, moved = {}, {}
    for mode in ("fsdp2", "autocast"):
        config = compose_config(
            ["model=micro", "seq_len=16", "batch_size=2", "trainer=fsdp2", "precision=bf16-mixed"]
            + [f"trainer.mixed_precision={mode}"]
        )
        session = open_session(config, "cuda")
        try:
            est = measure(session, build_policy(config.policy))
        finally:
            session.close()
        c = est.work.collectives
        assert c.sent_bytes > 0 and c.all_gathered_bytes > 0
        sent[mode] = c.sent_bytes
        moved[mode] = (c.all_gathered_bytes, c.reduce_scattered_bytes)
        t = est.step_time(roofline.gpu_speed(load_catalogue()["H100-80GB"]))
        assert t.collective_ms > 0 and t.exposed_collective_ms > 0
    assert sent["fsdp2"] < sent["autocast"]
    # bf16 gathers under FSDP2's policy, fp32 ones over fp32 shards under autocast; fp32 gradients reduced in both
    assert moved["autocast"] == (2 * moved["fsdp2"][0], moved["fsdp2"][1])
    # charged once: on the link by Collectives, not also as memory-bound kernels in the trace
    names = {n for n, _ in seen}
    assert {"_allgather_base_", "_reduce_scatter_base_"} <= names and {k for _, k in seen} == {"free"}, seen
    # and the copies around them charged what they read and write, each tensor once
    assert {"all_gather_copy_in", "split_with_sizes_copy", "chunk_cat", "_foreach_copy_"} <= {c[0] for c in copies}
    assert all(charged == moved for _, charged, moved in copies), copies


COLLECTIVE_CONFIG = ["model=micro", "model.n_layer=3", "seq_len=16", "batch_size=2", "trainer=fsdp2"]


def _collectives_worker(rank: int, world: int, store: str, out: str, overrides: list[str]) -> None:
    """A real FSDP2 rank on gloo, as train.py configures it: one micro-batch's forward and backward, its collectives
    counted by torch's CommDebugMode and sized from the c10d ops' own tensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainer.core import build
    from trainer.core.schema import compose_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        config = compose_config(overrides)
        module = build.module(config, "none", vocab_size=256, hf_config=None, precision=config.precision)
        module._device_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
        module.configure_model()
        sizes: dict[str, int] = {"_allgather_base_": 0, "_reduce_scatter_base_": 0}

        class Sizes(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                name = func._overloadpacket.__name__
                if name in sizes:  # (output, input): an all-gather's whole output, a reduce-scatter's whole input
                    whole = args[0] if name == "_allgather_base_" else args[1]
                    sizes[name] += whole.numel() * whole.element_size()
                return func(*args, **(kwargs or {}))

        batch = (torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
        with CommDebugMode() as comms, Sizes():  # bf16-mixed under FSDP2: its MixedPrecisionPolicy, no autocast
            module.loss_of(batch).backward()
        counts = {str(k): v for k, v in comms.get_comm_counts().items()}
        Path(out, f"{rank}.json").write_text(json.dumps({"counts": counts, "sizes": sizes}))
        dist.barrier()  # neither rank tears gloo down while the other is still in a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_the_collectives_model_counts_what_a_real_fsdp2_rank_runs(tmp_path: Path, precision: str) -> None:
    """The estimate's FSDP2 collectives (Collectives.fsdp2, from each layer's resharding as configure_model set it)
    against a real 2-rank FSDP2 step on gloo, counted by torch's CommDebugMode: the same number of all-gathers and
    reduce-scatters, and the same bytes gathered and reduced. The last layer is not resharded after the forward
    (torchtitan's rule), so the backward gathers one layer fewer than the forward."""
    import tempfile

    import torch.multiprocessing as mp

    from trainer.core.schema import compose_config
    from trainer.estimate import measure, open_session
    from trainer.policies import build_policy

    overrides = [*COLLECTIVE_CONFIG, f"precision={precision}"]
    mp.spawn(_collectives_worker, args=(2, tempfile.mktemp(dir=tmp_path), str(tmp_path), overrides), nprocs=2)
    run = json.loads((tmp_path / "0.json").read_text())
    session = open_session(compose_config(overrides), "cuda")
    try:
        model = measure(session, build_policy("none")).work.collectives
    finally:
        session.close()
    gathers = run["counts"].get("c10d._allgather_base_", 0) + run["counts"].get("c10d.allgather_", 0)
    reduces = run["counts"].get("c10d._reduce_scatter_base_", 0) + run["counts"].get("c10d.reduce_scatter_", 0)
    assert (model.all_gathers, model.reduce_scatters) == (gathers, reduces) == (3 + 1 + 2, 3 + 1), run
    assert model.all_gathered_bytes == run["sizes"]["_allgather_base_"]
    assert model.reduce_scattered_bytes == run["sizes"]["_reduce_scatter_base_"]


def test_rates_are_interpolated_log_log_and_flat_beyond_the_ends() -> None:
    curve = ((1e3, 1e9), (1e5, 1e11))
    assert roofline._rate(curve, 1e4) == pytest.approx(1e10)
    assert roofline._rate(curve, 10) == 1e9 and roofline._rate(curve, 1e9) == 1e11


def test_a_catalogue_gpu_states_its_assumptions() -> None:
    """A GPU is priced at the middle of its published efficiency ranges (conf/gpu/h100-80gb.yaml: matmul 0.62-0.80,
    HBM 0.87-0.89, NCCL 0.71-0.80), and carries the two ends for its interval."""
    gpus = load_catalogue()
    speed = roofline.gpu_speed(gpus["H100-80GB"], fp32_matmul="fp32")
    assert speed.overlapped and speed.matmul["bf16"][0][1] == pytest.approx(989e12 * 0.71)
    text = speed.describe()
    assert "71% (published 62%-80%) of peak" in text and "88% (published 87%-89%) of 3.35 TB/s" in text
    assert "FSDP2 collectives at 76% (published 71%-80%) of 450 GB/s" in text
    assert speed.gpu_link == pytest.approx(450e9 * 0.755)
    assert speed.ends is not None
    slow, fast = speed.ends
    assert slow.matmul["bf16"][0][1] == pytest.approx(989e12 * 0.62) and fast.gpu_link == pytest.approx(450e9 * 0.80)
    assert slow.op_s > speed.op_s > fast.op_s  # host costs: the slow end at their high end
    assert "collectives not costed" in roofline.gpu_speed(Gpu("bare", 2**30, 1e12, {"bf16": 1.0})).describe()
    with pytest.raises(ValueError, match="needs tflops and bandwidth"):
        roofline.gpu_speed(Gpu("bare", 2**30))
    assert calibration.speed_for("cuda").name == calibration.REFERENCE_GPU
    assert calibration.speed_for("cuda", "l4-24gb").name == "L4-24GB"
    with pytest.raises(ConfigError, match="not in the GPU catalogue; choose from"):
        calibration.speed_for("cuda", "Z9000")
    with pytest.raises(ConfigError, match="--gpu bare: the catalogue entry needs tflops and bandwidth"):
        calibration.speed_for("cuda", Gpu("bare", 2**30))


def test_every_catalogue_gpu_names_where_its_efficiencies_were_published() -> None:
    """Each figure the GPU time model takes beyond a datasheet is a published range with its source; a GPU with no
    published figure takes the widest range of those that have one, and says so. Bad entries are one line."""
    for gpu in load_catalogue().values():
        for key, e in roofline.gpu_constants(gpu):
            assert 0 < e.low <= e.high and e.source, (gpu.name, key)
            if key in ("launch_s", "sac_s"):
                continue
            assert e.low <= 1
            if gpu.name in ("H100-80GB", "A100-80GB"):  # measured on those parts: their own sources
                assert "no published figure" not in e.source and not e.source.startswith("as "), (gpu.name, key)
    h100, b200 = load_catalogue()["H100-96GB"], load_catalogue()["B200-192GB"]
    assert h100.efficiency_of("matmul").source.startswith("as H100-80GB: ")
    assert "no published figure for this GPU" in b200.efficiency_of("attention").source


@pytest.mark.parametrize(
    "block, says",
    [
        ("efficiency: {matmul: {range: [0.9, 0.5], source: x}}", "0 < low ≤ high ≤ 1"),
        ("efficiency: {matmul: {range: [0.5, 0.9]}}", "source: where it was published"),
        ("efficiency: {gemm: {range: [0.5, 0.9], source: x}}", "not one of matmul, bandwidth"),
        ("efficiency: {from: Z9000}", "no catalogue entry named 'Z9000'"),
        ("efficiency: {from: H100-96GB}", "H100-96GB takes its own from H100-80GB; name H100-80GB here"),
        ("measured: {matmul_tflops: {bf16: fast}}", "x.yaml: measured:"),
    ],
)
def test_a_bad_efficiency_block_is_one_line(tmp_path: Path, block: str, says: str) -> None:
    (tmp_path / "x.yaml").write_text(f"name: X1\nmemory: 8GiB\nbandwidth: 1TB/s\ntflops: {{bf16: 100}}\n{block}\n")
    with pytest.raises(ConfigError, match=re.escape(says)) as e:
        load_catalogue([tmp_path])
    assert "\n" not in str(e.value)


def test_attention_kernels_are_priced_at_the_gpus_attention_efficiency() -> None:
    """The fused attention kernels (kind `attention`) run at the GPU's attention efficiency, the GEMMs at its matmul
    one: on the H100 (attention 0.32-0.37 of peak, matmul 0.62-0.80) the same FLOPs take about twice as long."""
    speed = roofline.gpu_speed(load_catalogue()["H100-80GB"])
    flops = 10**12
    work = Work()
    work.ops[OpKey("attention", "bf16", flops, 0)] = 1
    t = speed.predict(work)
    assert t.attention_ms == pytest.approx(flops / (989e12 * 0.345) * 1e3)
    work2 = Work()
    work2.ops[OpKey("matmul", "bf16", flops, 0)] = 1
    assert speed.predict(work2).matmul_ms == pytest.approx(flops / (989e12 * 0.71) * 1e3)
    with FakeTensorMode():  # the CUDA flash kernel and its backward are traced as attention
        q = torch.empty(1, 2, 64, 32, dtype=torch.bfloat16, requires_grad=True)
        kinds = {
            k.kind
            for k in _trace(lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, q, q)[0].sum().backward()).ops
        }
    assert "attention" in kinds


def test_the_cpu_is_calibrated_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration runs for real, one round of its micro-benchmark rather than the median of three: what is
    checked is the cache, and the figures it holds."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(calibration, "CALIBRATION_ROUNDS", 1)
    monkeypatch.setattr(calibration, "_CPU", {})
    speed = calibration.cpu_speed()
    files = list((tmp_path / "ckptlab").glob("cpu-speed-*.json"))
    assert len(files) == 1 and "measured now" in speed.describe()
    doc = json.loads(files[0].read_text())
    assert doc["threads"] == torch.get_num_threads() and set(doc["matmul"]) == {"fp32", "bf16"}
    assert set(doc["bandwidth"]) == {"memory", "math", "random"} and doc["op_s"] > 0 and doc["sac_s"] > 0
    monkeypatch.setattr(calibration, "_CPU", {})
    again = calibration.cpu_speed()
    assert "(cached)" in again.describe() and again.matmul == speed.matmul
    files[0].write_text(json.dumps({**doc, "matmul": None}))  # edited by hand: measured anew, not a traceback
    monkeypatch.setattr(calibration, "_CPU", {})
    assert "measured now" in calibration.cpu_speed().describe()
    assert json.loads(files[0].read_text())["matmul"] is not None


def test_the_matmul_curve_stops_at_its_plateau(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the first product that takes over _PLATEAU_S the curve is not measured (flat beyond its last point):
    where bf16 is emulated a 1024³ product alone takes a second."""
    monkeypatch.setattr(calibration, "_PLATEAU_S", 0.0)
    with torch.no_grad():
        curve = calibration._matmul_curve(torch.float32, 0.0)
    m, k, n = calibration._MATMUL_SHAPES[0]
    assert len(curve) == 1 and curve[0][0] == 2 * m * k * n and curve[0][1] > 0
    assert roofline._rate(curve, 1e12) == curve[0][1]


def test_op_sac_decisions_are_counted_and_full_makes_none() -> None:
    from trainer.policies import build_policy

    block = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    x = torch.randn(4, 16, requires_grad=True)
    for name, expect_sac in (("op_sac", True), ("full", False)):
        policy = build_policy({"name": name})
        work = _trace(lambda policy=policy: policy.run(block, x, 0).sum().backward())
        assert (work.sac_decisions > 0) is expect_sac, name


def test_sac_decisions_survive_a_reload_of_the_flops_module() -> None:
    """tests/test_flops.py reloads trainer.measure.time.flops
    (its registration must be idempotent). When the counter was
    a dict imported by value, a reload earlier in the same worker left the step-time model reading a stale one: no
    decision counted, and the op_sac test above failed or passed by which tests shared a worker."""
    import importlib

    import trainer.measure.time.flops

    importlib.reload(trainer.measure.time.flops)
    test_op_sac_decisions_are_counted_and_full_makes_none()


@pytest.mark.parametrize(
    "device, memory_gib, entry",
    [
        ("NVIDIA A100-SXM4-80GB", 80, "A100-80GB"),  # by prefix this was the 40 GB part
        ("NVIDIA A100-SXM4-40GB", 40, "A100-40GB"),
        ("NVIDIA GeForce RTX 4090", 24, "RTX4090-24GB"),  # "RTX 4090", spaced: by substring it fell back to the H100
        ("NVIDIA H100 80GB HBM3", 80, "H100-80GB"),
        ("NVIDIA L4", 22.5, "L4-24GB"),
        ("NVIDIA L40S", 45, None),  # not an L4: not in the catalogue (the reference GPU, said in a warning)
    ],
)
def test_a_cuda_device_finds_its_catalogue_entry_by_model_and_memory(
    device: str, memory_gib: float, entry: str | None
) -> None:
    from trainer.measure.gpus import match_device

    found = match_device(device, int(memory_gib * 2**30))
    assert (found.name if found else None) == entry


def test_causal_attention_is_timed_at_the_flops_its_kernel_runs() -> None:
    """torch's SDPA formulas ignore is_causal; a causal flash kernel skips the scores above the diagonal. The time
    model costs s(s+1)/2 of s² (forward and backward); the FLOPs figures keep torch's count."""
    import torch.nn.functional as F

    s = 128
    q, k, v = (torch.randn(2, 4, s, 16, requires_grad=True) for _ in range(3))

    def matmul_flops(causal: bool) -> tuple[int, int]:
        with OpTrace() as t:
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()
        return sum(key.flops * n for key, n in t.work.ops.items() if key.kind == "attention"), t.total

    full, full_total = matmul_flops(False)
    causal, causal_total = matmul_flops(True)
    assert full > 0 and causal_total == full_total
    assert causal == pytest.approx(full * (s + 1) / (2 * s), rel=1e-6)


def test_bytes_moved_count_each_input_once_gathers_by_row_and_in_place_writes() -> None:
    """What the memory-bound ops are timed by: `x * x` reads x once; an embedding lookup reads its ids' rows, not
    the table; nll_loss one log-probability per target; `_foreach_add_` (which returns nothing) writes its lists."""

    def moved(fn: Any) -> int:
        with OpTrace() as t:
            fn()
        return sum(k.nbytes * n for k, n in t.work.ops.items())

    f32, i64 = 4, 8
    x = torch.randn(256, 256)
    assert moved(lambda: x * x) == 2 * x.numel() * f32  # read once, written once
    table, ids = torch.randn(1000, 64), torch.randint(0, 1000, (4, 16))
    assert moved(lambda: torch.nn.functional.embedding(ids, table)) == ids.numel() * (i64 + 2 * 64 * f32)
    logp, target = torch.randn(64, 1000).log_softmax(-1), torch.randint(0, 1000, (64,))
    # one log-probability per target, the targets, the loss and its total weight
    assert moved(lambda: torch.nn.functional.nll_loss(logp, target)) == 64 * (f32 + i64) + 2 * f32
    params, grads = [torch.randn(100) for _ in range(3)], [torch.randn(100) for _ in range(3)]
    assert moved(lambda: torch._foreach_add_(params, grads)) == 3 * 100 * f32 * 3  # two lists read, one written


def test_a_cpu_times_each_op_at_its_shapes_once_and_keeps_it(tmp_path: Path) -> None:
    """trainer.measure.time.calibration.OpClock:
    an op traced on fake tensors is replayed once on real ones of its dtypes,
    shapes and strides, the RNG left as it was (a replayed dropout draws nothing the run would draw); the time is kept
    on disk and read back by the next clock; an op too large to time, or one that reads a value back, is priced by
    the roofline instead (None)."""
    from trainer.measure.time.calibration import OpClock
    from trainer.measure.time.op_replay import recipe

    with FakeTensorMode():
        work = _trace(lambda: torch.ones(256, 512).bernoulli_(0.5) @ torch.ones(512, 128).t().contiguous().t())
    signed = [k for k in work.ops if k.signature]
    assert {k.kind for k in signed} >= {"random", "matmul"}  # and the fills torch.ones runs
    (mm,) = [k for k in signed if k.kind == "matmul"]
    assert mm.signature == "aten.mm.default(float32[256, 512][512, 1], float32[512, 128][1, 512])"
    path = tmp_path / "ops.json"
    clock = OpClock(path)
    rng = torch.get_rng_state()
    with FakeTensorMode():  # as the planner predicts, inside the estimator's fake session
        times = {k.signature: clock(k.signature, 0.0) for k in signed}
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(t is not None and t > 0 for t in times.values())
    clock.flush()
    assert OpClock(path).times == times and OpClock(path, fresh=True).times == {}
    assert clock("not traced", 0.0) is None
    assert OpClock(tmp_path / "other.json")(mm.signature, OpClock.MAX_S * 2) is None  # too long to time
    assert recipe(torch.ops.aten._local_scalar_dense.default, (torch.ones(()),), {}) is None


def test_an_op_whose_workspace_cannot_be_measured_raises_naming_it() -> None:
    """op_replay.inside_bytes measures a reduced-precision matmul's workspace on real tensors of its signature; an op
    that fails there is an error naming that signature, not a workspace of 0 that would make the estimate low."""
    from trainer.measure.time.op_replay import inside_bytes

    a, b = torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(16, 2, dtype=torch.bfloat16)  # 8 ≠ 16: mm refuses
    with pytest.raises(RuntimeError, match=r"workspace of aten\.mm\.default\(bfloat16\[4, 8\]\[8, 1\], bfloat16"):
        inside_bytes(torch.ops.aten.mm.default, (a, b), {})
    assert inside_bytes(torch.ops.aten.mm.default, (a, b.view(8, 4)), {}) >= 0  # the same op on shapes it takes
