"""The GPU catalogue: one yaml per GPU in conf/gpu/ (memory, bandwidth, peak throughput per dtype, host and GPU links),
which the estimator's fit table reads. A user adds a GPU by adding a file there, or names other files or folders
with `--catalogue`; an entry of the same name replaces the shipped one.

The reserve: what a GPU's memory holds besides the step's tensors, which no estimate on tensors can see: the CUDA
context (about 0.5–1 GiB), cuBLAS/cuDNN workspaces, NCCL buffers and the caching allocator's fragmentation.
`DEFAULT_RESERVE` keeps 1 GiB plus 5 % of the memory free; `--reserve` changes it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from omegaconf import OmegaConf

from trainer import CONF
from trainer.errors import ConfigError

CATALOGUE = CONF / "gpu"
DEFAULT_RESERVE = "1GiB+5%"

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, what: str = "--budget") -> int:
    """'40GB' (10⁹ bytes), '40GiB' (2³⁰), '40000MiB', '1.5TB', '123456' (bytes); case-insensitive."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"{what} {text!r}: write a positive size such as 40GB, 40GiB or 40000MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _rate(text: str, what: str) -> float:
    """'3.35TB/s' → bytes per second."""
    size, slash, unit = str(text).partition("/")
    if slash != "/" or unit.strip() != "s":
        raise ValueError(f"{what} {text!r}: write a rate such as 3.35TB/s")
    return float(parse_size(size, what))


@dataclass(frozen=True)
class Reserve:
    """Memory a GPU keeps free of the step's tensors: a fixed part plus a fraction of its memory."""

    fixed_bytes: int = 0
    fraction: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Reserve:
        """'1GiB+5%', '2GiB', '8%' or '0'."""
        fixed, fraction = 0, 0.0
        for part in str(text).replace(" ", "").split("+"):
            if part.endswith("%"):
                try:
                    fraction += float(part[:-1]) / 100
                except ValueError:
                    fraction = -1.0
            elif part not in ("0", ""):
                fixed += parse_size(part, "--reserve")
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"--reserve {text!r}: write a size, a percentage or both, such as 1GiB+5%")
        return cls(fixed, fraction)

    def usable(self, memory_bytes: int) -> int:
        return max(0, int(memory_bytes * (1 - self.fraction)) - self.fixed_bytes)

    def describe(self) -> str:
        parts = ([f"{self.fixed_bytes / 2**30:g} GiB"] if self.fixed_bytes else []) + (
            [f"{self.fraction * 100:g} % of the memory"] if self.fraction else []
        )
        return " + ".join(parts) or "none"


EFFICIENCY_KEYS = ("matmul", "bandwidth", "attention", "link")


@dataclass(frozen=True)
class Efficiency:
    """What kernels reach of a datasheet figure, as the range published measurements give (`low`, `high`), and
    where they were published (`source`). The step-time model prices a GPU at both ends and in the middle."""

    low: float
    high: float
    source: str

    @property
    def mid(self) -> float:
        return (self.low + self.high) / 2


@dataclass(frozen=True)
class Measured:
    """A `measured:` block (bench/calibrate.py): rates measured on this device at a model's shapes, preferred over
    the published ranges. FLOP/s and bytes/s per dtype; `launch_s`: one small op launched."""

    on: str
    date: str
    matmul: dict[str, float] = field(default_factory=dict)
    attention: dict[str, float] = field(default_factory=dict)
    bandwidth: float = 0.0
    launch_s: float | None = None

    def describe(self) -> str:
        return f"measured on {self.on} by bench.calibrate ({self.date})"


@dataclass(frozen=True)
class Gpu:
    """One catalogue entry. `tflops`: dense peak per dtype (bf16, fp16, tf32, fp32); `host_link`: host↔device copy
    rate in bytes per second; `gpu_link`: what one GPU sends to its peers per second (FSDP2's collectives)."""

    name: str
    memory_bytes: int
    bandwidth: float = 0.0  # bytes per second
    tflops: dict[str, float] = field(default_factory=dict)
    host_link: float = 0.0
    gpu_link: float = 0.0  # bytes/s one GPU sends to its peers (NVLink per direction; PCIe where there is none)
    source: str = ""
    # matmul (dense GEMM of tflops), bandwidth (streaming), attention (fused attention kernels of tflops), link (NCCL
    # ring of gpu_link): published ranges; a key the entry lacks is `fallback_efficiency`'s
    efficiency: dict[str, Efficiency] = field(default_factory=dict)
    efficiency_from: str = ""  # another entry's ranges for the keys this one does not give
    measured: Measured | None = None  # bench/calibrate.py's figures for this device, preferred where given

    def efficiency_of(self, key: str) -> Efficiency:
        """This GPU's range for `key`, or, where the catalogue has no published figure for it, the widest range of
        the shipped entries that have one (said so in its source)."""
        return self.efficiency.get(key) or fallback_efficiency(key)


def _entry(path: Path) -> Gpu:
    try:
        node = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as e:  # the YAML parser's own errors span lines; one line names the file and where
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(f"GPU catalogue entry {path}: not valid YAML{at}; see conf/gpu/*.yaml for the form") from None
    if not isinstance(node, dict) or not {"name", "memory"} <= node.keys():
        raise ConfigError(f"GPU catalogue entry {path}: needs at least `name` and `memory` (e.g. memory: 80GiB)")
    try:
        return Gpu(
            name=str(node["name"]),
            memory_bytes=parse_size(node["memory"], f"{path.name}: memory"),
            bandwidth=_rate(node["bandwidth"], f"{path.name}: bandwidth") if "bandwidth" in node else 0.0,
            tflops=_tflops(node.get("tflops") or {}, path),
            host_link=_rate(node["host_link"], f"{path.name}: host_link") if "host_link" in node else 0.0,
            gpu_link=_rate(node["gpu_link"], f"{path.name}: gpu_link") if "gpu_link" in node else 0.0,
            source=str(path),
            efficiency=_efficiency(node.get("efficiency") or {}, path),
            efficiency_from=str((node.get("efficiency") or {}).get("from", "")),
            measured=_measured(node["measured"], path) if node.get("measured") else None,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _efficiency(node: object, path: Path) -> dict[str, Efficiency]:
    """`efficiency: {from: NAME, matmul: {range: [low, high], source: "..."}, ...}`."""
    if not isinstance(node, dict):
        example = "{matmul: {range: [0.6, 0.8], source: ...}}"
        raise ValueError(f"{path.name}: efficiency: write a mapping such as {example}")
    out = {}
    for key, value in node.items():
        if key == "from":
            continue
        if key not in EFFICIENCY_KEYS:
            raise ValueError(f"{path.name}: efficiency.{key}: not one of {', '.join(EFFICIENCY_KEYS)}")
        try:
            low, high = (float(x) for x in value["range"])
            source = str(value["source"]).strip()
        except (TypeError, KeyError, ValueError):
            low, high, source = -1.0, -1.0, ""
        if not (0 < low <= high <= 1 and source):
            raise ValueError(
                f"{path.name}: efficiency.{key}: write {{range: [low, high], source: where it was published}}, "
                "0 < low ≤ high ≤ 1"
            )
        out[key] = Efficiency(low, high, source)
    return out


def _measured(node: object, path: Path) -> Measured:
    """`measured: {device, date, matmul_tflops: {bf16: …}, attention_tflops: {…}, bandwidth: 3TB/s, launch_s: …}`."""
    if not isinstance(node, dict):
        raise ValueError(f"{path.name}: measured: a mapping, as python -m bench.calibrate --write makes it")
    try:
        return Measured(
            on=str(node.get("device", "this device")),
            date=str(node.get("date", "")),
            matmul={k: float(v) * 1e12 for k, v in (node.get("matmul_tflops") or {}).items()},
            attention={k: float(v) * 1e12 for k, v in (node.get("attention_tflops") or {}).items()},
            bandwidth=_rate(node["bandwidth"], f"{path.name}: measured.bandwidth") if "bandwidth" in node else 0.0,
            launch_s=float(node["launch_s"]) if node.get("launch_s") is not None else None,
        )
    except (AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"{path.name}: measured: {e}; remake it with python -m bench.calibrate --write") from None


def _inherit(gpus: dict[str, Gpu]) -> dict[str, Gpu]:
    """Each entry's `efficiency.from`: the named entry's ranges for the keys it does not give itself."""
    out = {}
    for name, gpu in gpus.items():
        if gpu.efficiency_from:
            base = {k.lower(): v for k, v in gpus.items()}.get(gpu.efficiency_from.lower())
            if base is None:
                raise ConfigError(f"{gpu.source}: efficiency.from: no catalogue entry named {gpu.efficiency_from!r}")
            if base.efficiency_from:  # one level: a chain would leave what the middle entry lacks unresolved
                raise ConfigError(
                    f"{gpu.source}: efficiency.from: {base.name} takes its own from {base.efficiency_from}; "
                    f"name {base.efficiency_from} here"
                )
            inherited = {
                k: Efficiency(e.low, e.high, f"as {base.name}: {e.source}")
                for k, e in base.efficiency.items()
                if k not in gpu.efficiency
            }
            gpu = replace(gpu, efficiency={**inherited, **gpu.efficiency})
        out[name] = gpu
    return out


@functools.cache
def fallback_efficiency(key: str) -> Efficiency:
    """Where the catalogue has no published figure for a GPU: the widest range over the shipped entries that have
    one, so the interval holds every sourced GPU's."""
    ranges = [g.efficiency[key] for g in load_catalogue().values() if key in g.efficiency]
    return Efficiency(
        min(r.low for r in ranges),
        max(r.high for r in ranges),
        "no published figure for this GPU: the widest range of the catalogue's GPUs that have one",
    )


def _tflops(node: object, path: Path) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in node.items()}  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        raise ValueError(f"{path.name}: tflops {node!r}: write peak TFLOP/s per dtype, e.g. {{bf16: 989}}") from None


def load_catalogue(extra: list[str | Path] | None = None) -> dict[str, Gpu]:
    """The shipped catalogue, then each of `extra` (a yaml file or a folder of them) over it, by name."""
    gpus: dict[str, Gpu] = {}
    for where in [CATALOGUE, *(Path(p) for p in extra or [])]:
        if where.is_dir():
            files = sorted(where.glob("*.yaml"))
        elif where.is_file():
            files = [where]
        else:
            raise ConfigError(f"--catalogue {where}: no such file or folder; give a yaml file or a folder of them")
        for f in files:
            gpu = _entry(f)
            gpus[gpu.name] = gpu
    gpus = _inherit(gpus)
    return dict(sorted(gpus.items(), key=lambda kv: (kv[1].memory_bytes, kv[0])))


def find_gpu(name: str, catalogue: list[str] | None = None) -> Gpu:
    """A catalogue GPU by name, any case; an unknown name is one line listing the names there are."""
    gpus = load_catalogue(catalogue)
    found = {k.lower(): v for k, v in gpus.items()}.get(name.lower())
    if found is None:
        raise ConfigError(f"--gpu {name}: not in the GPU catalogue; choose from {', '.join(gpus)} (conf/gpu/)")
    return found


def _model_pattern(entry: str) -> re.Pattern[str]:
    """An entry's model (the name before its first '-': A100, L4, RTX4090) as a whole word of a device's name, its
    letters and digits optionally apart ("NVIDIA GeForce RTX 4090"): L4 is not L40S, A100 is A100-SXM4-80GB's."""
    model = entry.split("-")[0]
    spaced = r"\s*".join(re.escape(part) for part in re.findall(r"[A-Za-z]+|\d+", model))
    return re.compile(rf"(?<![A-Za-z0-9]){spaced}(?![A-Za-z0-9])", re.IGNORECASE)


def match_device(device_name: str, total_memory_bytes: int, catalogue: list[str] | None = None) -> Gpu | None:
    """The catalogue entry for a CUDA device: its model named as a whole word in the device's name, and of the
    entries of that model, the one whose memory is nearest the device's (A100-80GB, not A100-40GB); None where
    no entry is that model (an L40S, say)."""
    same_model = [g for g in load_catalogue(catalogue).values() if _model_pattern(g.name).search(device_name)]
    return min(same_model, key=lambda g: abs(g.memory_bytes - total_memory_bytes), default=None)


__all__ = [
    "CATALOGUE",
    "DEFAULT_RESERVE",
    "Gpu",
    "Reserve",
    "find_gpu",
    "load_catalogue",
    "match_device",
    "parse_size",
]
