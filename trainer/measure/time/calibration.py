"""Which speed a step-time prediction is for: this CPU, calibrated once by a short micro-benchmark (cached on disk),
or a catalogue GPU (trainer.measure.time.roofline.gpu_speed); the device a process runs on, matched.

    speed = cpu_speed()                 # this CPU at the current thread count
    speed = speed_for("cuda", "H100-80GB")
    speed = speed_here(device)          # a run's own device

Near tool: `torch.utils.benchmark.Timer` times one statement; `torch.distributed._tools.RuntimeEstimator`'s
benchmark mode runs each op on a real CUDA device. Here the CPU the estimate runs on is calibrated once (matmul and
bandwidth curves, cached) and each traced op replayed once per signature, so a CPU prediction costs seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from trainer.errors import ConfigError
from trainer.formatting import flops_text, one_line
from trainer.measure.gpus import Gpu, find_gpu, match_device
from trainer.measure.time.flops import count_sac_decision
from trainer.measure.time.op_replay import RECIPES, Recipe
from trainer.measure.time.op_trace import KINDS, OpTrace
from trainer.measure.time.roofline import RateCurve, Speed, gpu_speed

log = logging.getLogger(__name__)

CALIBRATION_VERSION = 6
_MATMUL_SHAPES = ((256, 64, 64), (256, 256, 256), (1024, 256, 256), (1024, 256, 1024), (1024, 1024, 1024))
_POINTWISE_SIZES = (2**10, 2**14, 2**18, 2**20, 2**22)


def _median_s(fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _chain(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = x * w + 1.0
    return x


def _per_op_s() -> tuple[float, float]:
    """The fixed cost of one op launched (a forward and backward chain of tiny pointwise ops, autograd included)
    and of one view."""
    w = torch.full((8,), 0.5, requires_grad=True)

    def step() -> None:
        x = torch.ones(8, requires_grad=True)
        y = _chain(x, w, 64).sum()
        if y.requires_grad:  # under no_grad: the bare dispatch cost the rate curves take out
            y.backward()

    with OpTrace() as t:
        step()
    ops = sum(t.work.count(k) for k in KINDS)
    op_s = _median_s(step, 15, 2) / max(ops, 1)
    v = torch.ones(8, 8)
    views = 256

    def view_loop() -> None:
        y = v
        for _ in range(views // 2):
            y = y.t().view(8, 8)

    return op_s, _median_s(view_loop, 15, 2) / views


def _sac_s(op_s: float) -> float:
    """One SAC decision: a checkpointed chain of tiny ops with torch's SAC contexts, less the same without them,
    per decision."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def decide(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        count_sac_decision()
        return CheckpointPolicy.PREFER_RECOMPUTE

    w = torch.full((8,), 0.5, requires_grad=True)

    def run(sac: bool) -> Callable[[], None]:
        def step() -> None:
            x = torch.ones(8, requires_grad=True)
            kw: dict[str, Any] = {"context_fn": lambda: create_selective_checkpoint_contexts(decide)} if sac else {}
            checkpoint(_chain, x, w, 64, use_reentrant=False, **kw).sum().backward()

        return step

    with OpTrace() as t:
        run(True)()
    decisions = max(t.work.sac_decisions, 1)
    delta = _median_s(run(True), 11, 2) - _median_s(run(False), 11, 2)
    return max(delta / decisions, op_s / 4)


_COLD_BYTES = 256 * 2**20  # more than a server CPU's last-level cache share: each timed op reads cold data


def _cold(make: Callable[[], tuple[torch.Tensor, ...]], nbytes: int) -> list[tuple[torch.Tensor, ...]]:
    """Enough distinct operand sets that cycling through them leaves none in cache: a step's tensors come from
    memory, not from the op before."""
    return [make() for _ in range(max(2, min(32, _COLD_BYTES // max(nbytes, 1))))]


def _cycled_s(fn: Callable[..., Any], pool: list[tuple[torch.Tensor, ...]], reps: int) -> float:
    it = iter(range(10**9))
    return _median_s(lambda: fn(*pool[next(it) % len(pool)]), reps, warmup=len(pool) % 3 + 1)


# A product this long is compute-bound at its plateau: larger shapes would add seconds (a minute per calibration
# where bf16 is emulated, at ~2 GFLOP/s) and no information; the curve is flat beyond its last point.
_PLATEAU_S = 0.05


def _matmul_curve(dtype: torch.dtype, op_s: float) -> RateCurve:
    """FLOP/s by op size: the median over a step's layouts (A·B, Aᵀ·B as weight gradients take it, A·Bᵀ as a linear
    layer takes its weight) and over batched products (attention's), each on cold operands; up to the first size
    whose product takes over _PLATEAU_S."""
    points = []
    for m, k, n in _MATMUL_SHAPES:
        flops = 2 * m * k * n
        nbytes = (m * k + k * n) * torch.finfo(dtype).bits // 8
        shapes = [((m, k), (k, n)), ((k, m), (k, n)), ((m, k), (n, k)), ((16, m // 16, k), (16, k, n))]
        products = [lambda a, b: a @ b, lambda a, b: a.t() @ b, lambda a, b: a @ b.t(), torch.bmm]
        layouts = [
            (lambda sa=sa, sb=sb: (torch.full(sa, 0.5, dtype=dtype), torch.full(sb, 0.5, dtype=dtype)), fn)
            for (sa, sb), fn in zip(shapes, products, strict=True)
        ]
        reps = 3 if flops < 1e9 else 2
        t = statistics.median(_cycled_s(fn, _cold(make, nbytes), reps) for make, fn in layouts)
        points.append((float(flops), flops / max(t - op_s, t / 2)))
        if t > _PLATEAU_S:
            break
    return tuple(points)


def _bandwidth_curves(op_s: float) -> dict[str, RateCurve]:
    """Bytes/s by op size for each kind of memory-bound op, on cold tensors: `memory` a product (reads two, writes
    one), `math` the median of GELU, softmax and layer norm (read one, write one), `random` a dropout mask drawn in
    place."""
    kinds: dict[str, list[tuple[Callable[[int], tuple[torch.Tensor, ...]], Callable[..., Any], int]]] = {
        "memory": [(lambda n: (torch.full((n,), 0.5), torch.full((n,), 0.5)), torch.mul, 3)],
        "math": [
            (lambda n: (torch.full((n // 256, 256), 0.5),), torch.nn.functional.gelu, 2),
            (lambda n: (torch.full((n // 256, 256), 0.5),), lambda x: torch.softmax(x, -1), 2),
            (lambda n: (torch.full((n // 256, 256), 0.5),), lambda x: torch.nn.functional.layer_norm(x, (256,)), 2),
        ],
        "random": [(lambda n: (torch.empty(n),), lambda x: x.bernoulli_(0.9), 2)],  # in place: read and written
    }
    out = {}
    for kind, ops in kinds.items():
        points = []
        for n in _POINTWISE_SIZES:
            nbytes = 4 * n
            t = statistics.median(
                _cycled_s(fn, _cold(lambda make=make, n=n: make(n), nbytes * k), 11 if n < 2**22 else 5)
                for make, fn, k in ops
            )
            moved = nbytes * ops[0][2]
            points.append((float(moved), moved / max(t - op_s, t / 2)))
        out[kind] = tuple(points)
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_path(key: str) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "ckptlab" / f"cpu-speed-{key}.json"


class OpClock:
    """This CPU's own time for each op a predicted step runs, by signature
    (trainer.measure.time.op_replay): the op replayed
    on real tensors of its dtypes, shapes and strides, after a warm-up, the median of a few runs cycled over enough
    copies of its operands that they come from memory (as a step's do), less the cost of calling an op from Python
    (the step-time model counts that apart, per op launched). Measured once per signature and kept on disk beside the
    calibration. Why replayed rather than priced: a CPU runs some kernels far off the calibrated rates at some shapes
    (a batched product with a small inner dimension, a broadcast masked_fill, a softmax over short rows, a single
    thread), where a roofline's guess is off by several times. Not replayed: an op whose roofline time is over
    MAX_S or whose operands hold over MAX_BYTES (a large model's ops stay priced); the RNG is left as it was."""

    MAX_S = 0.05
    MAX_BYTES = 256 * 2**20
    COLD_BYTES = 64 * 2**20

    def __init__(self, path: Path | None, fresh: bool = False) -> None:
        self.path = path
        self.times: dict[str, float | None] = {} if fresh or path is None else self._read()
        self.new: dict[str, float | None] = {}
        self._call_s: float | None = None

    def _read(self) -> dict[str, float | None]:
        try:
            doc = json.loads(self.path.read_text()) if self.path is not None and self.path.is_file() else {}
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in doc.items() if v is None or isinstance(v, float)} if isinstance(doc, dict) else {}

    def __call__(self, signature: str, roofline_s: float) -> float | None:
        if signature in self.times:
            return self.times[signature]
        how = RECIPES.get(signature)
        if how is None or roofline_s > self.MAX_S or how.nbytes > self.MAX_BYTES:
            return None
        self.times[signature] = self.new[signature] = t = self._time(how)
        return t

    def _time(self, how: Recipe) -> float | None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.utils._python_dispatch import _disable_current_modes

        with unset_fake_temporarily(), _disable_current_modes(), torch.random.fork_rng(devices=[]), torch.no_grad():
            try:
                if self._call_s is None:
                    one = torch.ones(1)
                    self._call_s = _median_s(lambda: torch.ops.aten.add.Tensor(one, one), 50, 5)
                copies = max(1, min(8, self.COLD_BYTES // max(how.nbytes, 1)))
                runs = [how.build() for _ in range(copies)]
                first = _median_s(runs[0], 1, 1)
                reps = max(3, min(15, int(0.02 / max(first, 1e-6))))
                it = iter(range(10**9))
                t = _median_s(lambda: runs[next(it) % copies](), reps, warmup=copies)
            except (RuntimeError, ValueError, IndexError, TypeError) as e:
                # an op that rejects made-up operands (a value it reads, say) is priced by the roofline instead, said
                # once: its None is kept on disk with the times, so this CPU does not try it again
                log.warning(
                    "%s does not run on made-up operands of its traced shapes (%s: %s); the step-time model prices "
                    "it by the roofline",
                    how.func,
                    type(e).__name__,
                    one_line(e, 200),
                )
                return None
        return max(t - self._call_s, t / 2)

    def flush(self) -> None:
        """Keep what was measured since the last flush (merged with what another process wrote meanwhile)."""
        if not self.new or self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            merged = {**self._read(), **self.new}
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(merged))
            tmp.replace(self.path)
        except OSError:
            pass  # not writable: measured again next time
        self.new = {}


def _speed_from(doc: dict[str, Any], source: str, clock: OpClock | None = None) -> Speed:
    mem = doc["bandwidth"]["memory"][-2]
    return Speed(
        name=doc["name"],
        matmul={k: tuple(tuple(p) for p in v) for k, v in doc["matmul"].items()},  # type: ignore[misc]
        bandwidth={k: tuple(tuple(p) for p in v) for k, v in doc["bandwidth"].items()},  # type: ignore[misc]
        op_s=doc["op_s"],
        free_s=doc["free_s"],
        sac_s=doc["sac_s"],
        assumptions=(
            f"calibrated on this CPU ({source}): matmul {flops_text(doc['matmul']['fp32'][-1][1])}/s fp32, "
            f"{flops_text(doc['matmul']['bf16'][-1][1])}/s bf16 (the largest products timed); pointwise "
            f"{mem[1] / 1e9:.1f} GB/s at {mem[0] / 2**20:.0f} MiB (cold)",
            f"{doc['op_s'] * 1e6:.1f} µs per op launched, {doc['sac_s'] * 1e6:.1f} µs per SAC decision, "
            f"{doc['threads']} thread(s), one op after another",
            "each op the step runs timed once on this CPU at its shapes (cached), the rates above for the rest "
            f"(ops over {OpClock.MAX_S * 1e3:g} ms or {OpClock.MAX_BYTES // 2**20} MiB, compiled kernels)",
        ),
        op_clock=clock,
    )


CALIBRATION_ROUNDS = 3


def _calibration_round() -> dict[str, Any]:
    with torch.no_grad():
        op_s0, _ = _per_op_s()
    op_s, free_s = _per_op_s()
    with torch.no_grad():
        matmul = {"fp32": _matmul_curve(torch.float32, op_s0), "bf16": _matmul_curve(torch.bfloat16, op_s0)}
        bandwidth = _bandwidth_curves(op_s0)
    return {"op_s": op_s, "free_s": free_s, "sac_s": _sac_s(op_s), "matmul": matmul, "bandwidth": bandwidth}


def _median_curves(curves: list[RateCurve]) -> RateCurve:
    return tuple((points[0][0], statistics.median(p[1] for p in points)) for points in zip(*curves, strict=True))


def calibrate_cpu() -> dict[str, Any]:
    """The micro-benchmark (several seconds): per-op cost, SAC's cost per decision, matmul throughput by size in fp32
    and bf16, memory-bound rates by size; each figure the median of CALIBRATION_ROUNDS rounds that each measure them
    all, so a shared machine's passing load does not set one figure alone."""
    rounds = [_calibration_round() for _ in range(CALIBRATION_ROUNDS)]
    first = rounds[0]
    return {
        "version": CALIBRATION_VERSION,
        "name": f"CPU {cpu_name()}",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "rounds": len(rounds),
        **{k: statistics.median(r[k] for r in rounds) for k in ("op_s", "free_s", "sac_s")},
        "matmul": {k: _median_curves([r["matmul"][k] for r in rounds]) for k in first["matmul"]},
        "bandwidth": {k: _median_curves([r["bandwidth"][k] for r in rounds]) for k in first["bandwidth"]},
    }


def cpu_key() -> str:
    text = f"{CALIBRATION_VERSION}|{cpu_name()}|{torch.__version__}|{torch.get_num_threads()}"
    return hashlib.sha1(text.encode()).hexdigest()[:12]


_CPU: dict[str, Speed] = {}


def _read_cached(path: Path, key: str) -> Speed | None:
    if not path.is_file():
        return None
    try:
        cached = json.loads(path.read_text())
        if cached["version"] == CALIBRATION_VERSION:
            return _speed_from(cached, "cached", OpClock(_ops_path(key)))
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        pass  # unreadable, another version's or half-written by hand: measured anew
    return None


@contextlib.contextmanager
def _calibrating(path: Path) -> Iterator[None]:
    """One process calibrates at a time (an exclusive lock beside the cache file): processes started together (a
    sweep's jobs, test workers) would each measure the CPU while the others load it, slower and worse, where the
    second can read the first's result. Without a writable cache folder, or without fcntl, no lock is taken."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "w")  # held across the yield
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        lock.close()  # releases the lock


def cpu_speed(recalibrate: bool = False) -> Speed:
    """This CPU at the current thread count: calibrated once and cached (on disk, keyed by CPU, torch and
    threads); `recalibrate` measures anew."""
    key = cpu_key()
    if key in _CPU and not recalibrate:
        return _CPU[key]
    path = _cache_path(key)
    if not recalibrate and (speed := _read_cached(path, key)) is not None:
        _CPU[key] = speed
        return speed
    with _calibrating(path):
        if not recalibrate and (speed := _read_cached(path, key)) is not None:  # another process measured it
            _CPU[key] = speed
            return speed
        doc = calibrate_cpu()
        source = "measured now"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(doc))
            tmp.replace(path)
        except OSError:
            source = "measured now, not cached: the cache folder is not writable"
    _CPU[key] = speed = _speed_from(doc, source, OpClock(_ops_path(key), fresh=recalibrate))
    return speed


def _ops_path(key: str) -> Path:
    return _cache_path(key).with_name(f"cpu-ops-{key}.json")


REFERENCE_GPU = "H100-80GB"  # a CUDA estimate's times when no GPU is named


def speed_for(device: str, gpu: Gpu | str | None = None, catalogue: list[str] | None = None) -> Speed:
    """The speed a prediction is for: a catalogue GPU (by entry or name; a CUDA device without one: the reference
    GPU), or this CPU calibrated."""
    if gpu is None and device != "cuda":
        return cpu_speed()
    if not isinstance(gpu, Gpu):
        gpu = find_gpu(gpu or REFERENCE_GPU, catalogue)
    try:
        return gpu_speed(gpu)
    except ValueError as e:  # a catalogue entry of memory only
        raise ConfigError(f"--gpu {e}") from None


def speed_here(device: torch.device | str, recalibrate: bool = False) -> Speed:
    """The speed of the device this process runs on: this CPU calibrated (`recalibrate`: now, as a benchmark does
    beside what it measures: a shared machine's speed drifts), or the catalogue entry whose name's model (H100,
    L4, ...) the CUDA device's name carries (the reference GPU where none does)."""
    device = torch.device(device)
    if device.type != "cuda":
        return cpu_speed(recalibrate)
    props = torch.cuda.get_device_properties(device)
    gpu = match_device(props.name, props.total_memory)
    if gpu is None:
        log.warning(
            "%s is not in the GPU catalogue: its times are predicted for the reference %s; add conf/gpu/<it>.yaml "
            "(or --catalogue) for its own figures",
            props.name,
            REFERENCE_GPU,
        )
        return speed_for("cuda")
    return gpu_speed(gpu)
