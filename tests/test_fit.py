"""Where a configuration fits (the fit table), what to change when it does not (the advice), and offload counted
where it goes (device and pinned host memory), each checked against direct estimates on fake tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_estimate import _cli
from trainer.core.schema import compose_config
from trainer.estimate import estimate_all, main, measure, open_session
from trainer.estimate.advise import advise, where_the_peak_is, with_overrides
from trainer.estimate.fit import FitTable, at_world, fit_table, shard_unit
from trainer.measure.gpus import CATALOGUE, Gpu, Reserve, load_catalogue
from trainer.policies import build_policy

SHAPE = ["model=llama-tiny", "seq_len=64", "batch_size=4"]
POLICIES = ["none", "full"]
MAX_WORLD = 8


@pytest.fixture(scope="module")
def direct() -> dict[int, dict[str, int]]:
    """One rank's whole-step peak at every world size 1…MAX_WORLD, each estimated directly."""
    config = compose_config(SHAPE)
    peaks: dict[int, dict[str, int]] = {}
    for w in range(1, MAX_WORLD + 1):
        session = open_session(at_world(config, w), "cuda")
        try:
            out = estimate_all(session.config, "cuda", session=session, only=POLICIES)
        finally:
            session.close()
        peaks[w] = {n: e.peak_bytes for n, e in out.items()}  # type: ignore[union-attr]
    return peaks


def test_the_catalogue_ships_the_gpus_teams_ask_about() -> None:
    names = set(load_catalogue())
    want = {"A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB", "B200-192GB", "MI300X-192GB", "L4-24GB"}
    assert want | {"RTX4090-24GB"} <= names
    h100 = load_catalogue()["H100-80GB"]
    assert h100.memory_bytes == 81559 * 2**20 and h100.tflops["bf16"] == 989 and h100.bandwidth == 3.35e12


def test_a_users_catalogue_adds_and_replaces_by_name(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text("name: H100-80GB\nmemory: 94GB\n")
    (tmp_path / "new.yaml").write_text("name: Tiny-1GB\nmemory: 1GiB\nbandwidth: 0.1TB/s\n")
    gpus = load_catalogue([tmp_path])
    assert gpus["H100-80GB"].memory_bytes == 94 * 10**9 and gpus["Tiny-1GB"].bandwidth == 1e11
    assert len(gpus) == len(list(CATALOGUE.glob("*.yaml"))) + 1


def test_reserve_parses_and_refuses() -> None:
    r = Reserve.parse("1GiB+5%")
    assert r.usable(100 * 2**30) == int(100 * 2**30 * 0.95) - 2**30
    assert Reserve.parse("0").usable(123) == 123 and Reserve.parse("8%").fraction == 0.08
    for bad in ("5XB", "120%", "abc%"):
        with pytest.raises(ValueError, match="--reserve"):
            Reserve.parse(bad)


def test_shard_bytes_follow_torch_chunk() -> None:
    """Rank 0 holds ceil(rows / world) rows of each parameter."""
    assert shard_unit([((10, 4), 4)], 3) == 4 * 4 * 4 and shard_unit([((10, 4), 4)], 16) == 1 * 4 * 4
    config = compose_config(SHAPE)
    one = open_session(config, "cuda")
    shapes = [(tuple(p.shape), p.element_size()) for p in one.module.parameters()]
    for w in (3, 4):
        s = open_session(at_world(config, w), "cuda")
        try:
            est = measure(s, build_policy(config.policy))
        finally:
            s.close()
        assert est.components["parameters"] == shard_unit(shapes, w)


def _check_cells(table: FitTable, direct: dict[int, dict[str, int]]) -> None:
    for cell in table.cells:
        fits = [w for w in range(1, MAX_WORLD + 1) if direct[w][cell.policy] <= cell.usable_bytes]
        want = fits[0] if fits else None
        assert cell.world_size == want, (cell, fits)
        if want is not None:
            peak = cell.per_rank_peak_bytes
            assert peak == direct[want][cell.policy] or cell.peak_is_bound and direct[want][cell.policy] <= peak
            assert peak is not None and peak <= cell.usable_bytes
            if want > 1:
                assert direct[want - 1][cell.policy] > cell.usable_bytes


def test_each_cell_is_the_smallest_world_size_a_direct_estimate_fits(direct: dict[int, dict[str, int]]) -> None:
    """Capacities a byte either side of each world size's peak: each cell's world size fits by a direct estimate
    and the next smaller one does not (so close to the boundaries, the table estimates those world sizes)."""
    peaks = {n: [direct[w][n] for w in range(1, MAX_WORLD + 1)] for n in POLICIES}
    capacities = sorted({p + d for n in POLICIES for p in peaks[n][1:] for d in (0, -1)} | {min(peaks["full"]) - 1})
    gpus = [Gpu(f"gpu{i}", c) for i, c in enumerate(capacities)]
    _check_cells(fit_table(compose_config(SHAPE), "cuda", gpus, Reserve(), POLICIES, max_world=MAX_WORLD), direct)


def test_between_the_boundaries_a_few_estimates_decide_every_cell(direct: dict[int, dict[str, int]]) -> None:
    """Capacities midway between world sizes' peaks: the bounds of three or four estimates decide every cell."""
    peaks = {n: [direct[w][n] for w in range(1, MAX_WORLD + 1)] for n in POLICIES}
    capacities = sorted({(a + b) // 2 for n in POLICIES for a, b in zip(peaks[n], peaks[n][1:], strict=False)})
    # and one roomy enough for one device, whatever the drop from one device's autocast to FSDP2's bf16 policy
    capacities.append(max(p[0] for p in peaks.values()) + 1)
    gpus = [Gpu(f"gpu{i}", c) for i, c in enumerate(capacities)]
    table = fit_table(compose_config(SHAPE), "cuda", gpus, Reserve(), POLICIES, max_world=MAX_WORLD)
    _check_cells(table, direct)
    assert len(table.worlds_estimated) <= 4, table.worlds_estimated
    assert {c.world_size for c in table.cells} >= {1, 2, 3, 4, 5}


def test_advice_prices_every_change_and_names_a_world_size_that_fits(direct: dict[int, dict[str, int]]) -> None:
    config = compose_config(SHAPE)
    budget = direct[3]["none"]  # none fits from 3 ranks on
    session = open_session(config, "cuda")
    try:
        from trainer.estimate.tables import estimate_tables

        table, losses = estimate_tables(config, "cuda", session=session)
        est = table["none"]
        rows = advise(session, est, table, losses, budget, max_world=MAX_WORLD)  # type: ignore[arg-type]
    finally:
        session.close()
    changes = [a.change for a in rows]
    assert "FSDP2 on 3 ranks" in changes and "loss=chunked" in changes and "policy=full" in changes
    assert {"micro-batch 2 × accum 2", "micro-batch 1 × accum 4"} <= set(changes)
    world = rows[changes.index("FSDP2 on 3 ranks")]
    assert world.fits and world.peak_bytes == direct[3]["none"]
    assert world.command(SHAPE).endswith("trainer=fsdp2 trainer.devices=3")
    full = rows[changes.index("policy=full")]
    assert full.peak_bytes == direct[1]["full"] and full.fits == (direct[1]["full"] <= budget)
    fitting = [a for a in rows if a.fits]
    assert rows[: len(fitting)] == fitting  # what fits first, each part by compute
    assert [a.flops_ratio for a in fitting] == sorted(a.flops_ratio for a in fitting)  # type: ignore[type-var]
    assert "the step peaks" in where_the_peak_is(est) and "GiB" in where_the_peak_is(est)  # type: ignore[arg-type]


def test_a_changed_policy_drops_the_old_policys_parameters() -> None:
    user = ["model=llama3-8b", "policy=first_k", "policy.k=2", "batch_size=8"]
    assert with_overrides(user, ["policy=full"]) == ["model=llama3-8b", "batch_size=8", "policy=full"]
    assert with_overrides(user, ["batch_size=4", "accum=2"])[-2:] == ["batch_size=4", "accum=2"]


def test_offload_estimated_for_cuda_moves_its_bytes_to_pinned_host_memory() -> None:
    """Under --device cuda, offload's device peak drops below none's by no more than the host holds, and the host
    holds exactly the bytes the policy offloaded (one micro-batch's saved tensors above policy.min_bytes)."""
    config = compose_config(SHAPE)
    session = open_session(config, "cuda")
    try:
        none = measure(session, build_policy(compose_config([*SHAPE, "policy=none"]).policy))
        policy = build_policy(compose_config([*SHAPE, "policy=offload"]).policy)
        off = measure(session, policy)
    finally:
        session.close()
    assert off.host_pinned_bytes == policy.offloader.bytes_offloaded > 0  # type: ignore[attr-defined]
    assert off.activation_bytes < 0.5 * none.activation_bytes
    assert 0 < none.activation_bytes - off.activation_bytes <= off.host_pinned_bytes
    assert 0 < none.peak_bytes - off.peak_bytes <= off.host_pinned_bytes
    assert none.host_pinned_bytes == 0 and off.flops == none.flops
    cpu = open_session(config, "cpu")
    try:
        on_cpu = measure(cpu, build_policy(compose_config([*SHAPE, "policy=offload"]).policy))
    finally:
        cpu.close()
    assert on_cpu.host_pinned_bytes == 0  # a CPU run moves nothing


@pytest.mark.slow
def test_cli_fit_and_advice_in_json(tmp_path: Path, direct: dict[int, dict[str, int]]) -> None:
    (tmp_path / "gpus").mkdir()
    (tmp_path / "gpus" / "small.yaml").write_text(f"name: Small\nmemory: {direct[2]['none']}\n")
    out = tmp_path / "est.json"
    budget = str(direct[4]["none"])
    r = _cli(
        *SHAPE,
        "--policies",
        "configured",
        "--fit",
        "--reserve",
        "0",
        "--catalogue",
        str(tmp_path / "gpus"),
        "--max-world",
        str(MAX_WORLD),
        "--budget",
        budget,
        "--json",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert "where it fits (loss=standard)" in r.stdout and "advice for policy=none" in r.stdout
    doc = json.loads(out.read_text())
    small = next(row for row in doc["fit"] if row["gpu"] == "Small")
    assert small == {
        "gpu": "Small",
        "memory_bytes": direct[2]["none"],
        "usable_bytes": direct[2]["none"],
        "policy": "none",
        "loss": "standard",
        "world_size": 2,
        "per_rank_peak_bytes": direct[2]["none"],
        "peak_is_bound": False,
        "predicted_step_ms": None,
    }  # no tflops in its entry: no time
    timed = [row for row in doc["fit"] if row["world_size"] is not None and row["gpu"] == "H100-80GB"]
    assert timed and all(row["predicted_step_ms"] > 0 for row in timed)
    assert "where it fits, fastest first (predicted, not measured" in r.stdout
    rows = {a["change"]: a for a in doc["advice"]["rows"]}
    assert rows["FSDP2 on 4 ranks"]["fits"] and rows["FSDP2 on 4 ranks"]["peak_bytes"] == direct[4]["none"]
    assert rows["FSDP2 on 4 ranks"]["command"].startswith("python train.py model=llama-tiny")


def test_advice_from_an_fsdp2_configuration_opens_the_other_world_sizes(
    direct: dict[int, dict[str, int]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A configuration already on 2 FSDP2 ranks: its session gives up its process group to the advice's own
    estimates at other world sizes (one process holds one group)."""
    budget = str(direct[4]["none"])
    args = [*SHAPE, "trainer=fsdp2", "trainer.devices=2", "--device", "cuda", "--policies", "configured"]
    assert main([*args, "--budget", budget, "--max-world", str(MAX_WORLD)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| FSDP2 on 4 ranks |"))
    assert "| yes |" in row and "trainer=fsdp2 trainer.devices=4" in row
    assert "| micro-batch 1 × accum 4 |" in out


@pytest.mark.parametrize(
    "args, says",
    [
        (["--advise"], "--advise prices changes against a budget"),
        (["--fit", "--reserve", "150%"], "--reserve"),
        (["--fit", "--catalogue", "/no/such/place"], "--catalogue /no/such/place"),
        (["--fit", "--max-world", "1"], "--max-world 1"),
        (["--fit", "--max-world", "5000"], "give 2 to 1024"),
    ],
)
def test_bad_fit_and_advice_options_are_one_line(
    args: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "never.json"
    assert main([*SHAPE, *args, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    "text, says",
    [
        ("name: [x\nmemory: 1GB\n", "not valid YAML (line 2)"),
        ("name: X\nmemory: 1GB\ntflops: {bf16: fast}\n", "tflops"),
        ("- a\n- b\n", "needs at least `name` and `memory`"),
        ("name: X\nmemory: lots\n", "memory 'lots'"),
    ],
)
def test_a_bad_catalogue_entry_is_one_line(
    text: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bad.yaml").write_text(text)
    assert main([*SHAPE, "--fit", "--catalogue", str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: pinned host memory is CUDA's")
def test_a_cuda_run_logs_the_pinned_host_memory_offload_used(tmp_path: Path) -> None:
    from tests.conftest import SMALL, run_cli

    r = run_cli(
        *SMALL, "policy=offload", "trainer.accelerator=gpu", "measure.predict=true", f"hydra.run.dir={tmp_path}"
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["host_pinned_peak_mib"] > 0


def test_the_fastest_first_list_costs_each_cell_at_its_own_world_size(direct: dict[int, dict[str, int]]) -> None:
    """A cell that fits at 4 ranks is timed by the estimate at 4 ranks (its optimizer steps a quarter of the state),
    not by the configured world's: each predicted time equals a direct estimate's at the cell's world size, and one
    policy's time differs between world sizes."""
    from trainer.estimate.cli import fit_times
    from trainer.measure.time.roofline import gpu_speed

    config = compose_config(SHAPE)
    h100 = load_catalogue()["H100-80GB"]
    sizes = {"one": direct[1]["none"], "two": direct[2]["none"], "four": direct[4]["none"]}
    gpus = [Gpu(f"{k}-rank", v, bandwidth=h100.bandwidth, tflops=dict(h100.tflops)) for k, v in sizes.items()]
    table = fit_table(config, "cuda", gpus, Reserve(), ["none"], max_world=MAX_WORLD)
    worlds = {c.gpu: c.world_size for c in table.cells}
    assert worlds == {"one-rank": 1, "two-rank": 2, "four-rank": 4}
    times = fit_times(table, gpus)
    for gpu in gpus:
        w = worlds[gpu.name]
        session = open_session(at_world(config, w or 1), "cuda")
        try:
            want = measure(session, build_policy("none")).step_time(gpu_speed(gpu)).ms
        finally:
            session.close()
        assert times[(gpu.name, "none")].ms == pytest.approx(want, rel=1e-9)
    assert times[("one-rank", "none")].ms != times[("four-rank", "none")].ms
