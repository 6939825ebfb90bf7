"""The sweep over the registry (a child process per family, resumable), its results and its command line."""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as dt
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from trainer import CONF
from trainer.families.family import (
    ESTIMATE_SLACK_BYTES,
    LOSS_TOLERANCE,
    MEMORY_MIB,
    POLICIES,
    STAGE_MARK,
    TIMEOUT_S,
    family_row,
)
from trainer.formatting import add_page_arguments, replace_block
from trainer.measure.time.calibration import cpu_name

START, END = "<!-- hf-families:start -->", "<!-- hf-families:end -->"
HEADING = "## Measured: every Hugging Face causal-LM family"
ROOT = CONF.parent
HF_FAMILIES_PAGE = ROOT / "docs" / "hf-families.md"  # the sweep's table
COMMAND = "python -m trainer.families"

# ----------------------------------------------------------------------------------------------------
# The sweep: one subprocess per family, results written as each finishes.
# ----------------------------------------------------------------------------------------------------


def registered_families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def child_env() -> dict[str, str]:
    """No network, one BLAS thread (2 shared cores), no warnings in the logs' way."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "TRANSFORMERS_VERBOSITY": "error",
        "TOKENIZERS_PARALLELISM": "false",
    }


def broken_row(model_type: str, reason: str, seconds: float) -> dict[str, Any]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {
        "model_type": model_type,
        "class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "?"),
        "status": "broken",
        "stage": "process",
        "loads": False,
        "attention": None,
        "n_layer": None,
        "params": None,
        "checks": {},
        "estimate": {},
        "loss": {},
        "reason": f"process: {reason}",
        "notes": [],
        "tiny": {},
        "seconds": {"total": round(seconds, 2)},
    }


class FamilyJob:
    def __init__(self, model_type: str, args: argparse.Namespace, out: Path) -> None:
        self.model_type = model_type
        self.row_file = out / "rows" / f"{model_type}.json"
        self.log_file = out / "logs" / f"{model_type}.log"
        self.row_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "trainer.families",
            "--one",
            model_type,
            "--row",
            str(self.row_file),
            "--policies",
            ",".join(args.policies),
            "--estimate-policies",
            ",".join(args.estimate_policies),
            "--memory-mib",
            str(args.memory_mib),
        ]
        self.log = self.log_file.open("w")
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=child_env(),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def kill(self) -> None:
        """End this job's process group (the child and whatever it started), nothing else."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def row(self, timed_out: bool, timeout: float) -> dict[str, Any]:
        self.log.close()
        if timed_out:
            marks = [ln for ln in self.log_file.read_text(errors="replace").splitlines() if ln.startswith(STAGE_MARK)]
            where = f" in {marks[-1][len(STAGE_MARK) :]}" if marks else ""
            return broken_row(self.model_type, f"timed out after {timeout:g} s{where}", self.elapsed())
        if self.row_file.is_file():
            return json.loads(self.row_file.read_text())
        code = self.proc.returncode
        why = f"killed by signal {-code}" if code < 0 else f"exited {code} without a row"
        tail = [ln for ln in self.log_file.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        return broken_row(self.model_type, why + (f" ({tail[0][:200]})" if tail else ""), self.elapsed())


def sweep(args: argparse.Namespace, out: Path, families: list[str], log: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = read_rows(out)
    done = {r["model_type"] for r in rows}
    todo = [f for f in families if f not in done]
    if done:
        log(f"{len(done)} families already in {out / 'rows.jsonl'}; {len(todo)} to go")
    meta = {"env": environment(args), "command": command_line(args), "families": families}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    running: list[FamilyJob] = []
    total, finished = len(todo), 0
    signal.signal(signal.SIGTERM, _terminated)  # `kill <pid>` of a background sweep ends its families too
    pending = list(todo)
    try:
        while pending or running:
            while pending and len(running) < args.jobs:
                running.append(FamilyJob(pending.pop(0), args, out))
            time.sleep(0.2)
            for job in list(running):
                timed_out = job.proc.poll() is None and job.elapsed() > args.timeout
                if timed_out:
                    job.kill()
                elif job.proc.poll() is None:
                    continue
                running.remove(job)
                row = job.row(timed_out, args.timeout)
                rows.append(row)
                with (out / "rows.jsonl").open("a") as f:
                    f.write(json.dumps(row) + "\n")
                write_results(out, rows, meta)
                finished += 1
                seconds = row["seconds"].get("total", 0)
                reason = f" {row['reason']}" if row["reason"] else ""
                log(f"[{finished}/{total}] {row['model_type']}: {row['status']} ({seconds:.0f} s){reason}")
    finally:
        for job in running:
            job.kill()
    write_results(out, rows, meta)
    return rows


def _terminated(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def read_rows(out: Path) -> list[dict[str, Any]]:
    path = out / "rows.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    latest = {r["model_type"]: r for r in rows}  # a family run twice: its last row
    return list(latest.values())


# ----------------------------------------------------------------------------------------------------
# Results: JSON, CSV, markdown.
# ----------------------------------------------------------------------------------------------------


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    return {
        "date": dt.date.today().isoformat(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "cpu": cpu_name(),
        "policies": list(args.policies),
        "estimate_policies": list(args.estimate_policies),
        "timeout_s": args.timeout,
        "jobs": args.jobs,
    }


def command_line(args: argparse.Namespace) -> str:
    parts = [COMMAND]
    if args.families:
        parts.append(f"--families {','.join(args.families)}")
    if tuple(args.policies) != POLICIES:
        parts.append(f"--policies {','.join(args.policies)}")
    if list(args.estimate_policies) != ["none", *(p for p in args.policies if p != "none")]:
        parts.append(f"--estimate-policies {','.join(args.estimate_policies)}")
    return " ".join(parts)


def check_cell(check: dict[str, Any] | None) -> str:
    if not check:
        return ""
    result = check["result"]
    return result if result in ("bitwise", "refused") or result.startswith("within") else f"{result}: {check['detail']}"


def estimate_cell(estimate: dict[str, Any]) -> str:
    cells = []
    for name, e in estimate.items():
        if "error" in e:
            cells.append(f"{name}: {e['error']}")
        else:
            cells.append(f"{name}: {e['activation_off']:+d}/{e['peak_off']:+d} B")
    return "; ".join(cells)


def flat(row: dict[str, Any], policies: Sequence[str]) -> dict[str, Any]:
    """One CSV line: the row's fields, one column per policy."""
    loss = row.get("loss") or {}
    out = {k: row.get(k) for k in ("model_type", "class", "status", "stage", "loads", "attention", "n_layer", "params")}
    out.update({f"check_{p}": check_cell(row["checks"].get(p)) for p in policies})
    out["estimate_off_bytes"] = estimate_cell(row.get("estimate") or {})
    out["loss_rel_diff"] = loss.get("rel_diff", loss.get("error", ""))
    out["reason"] = row.get("reason", "")
    out["notes"] = " | ".join(row.get("notes") or [])
    out["seconds"] = (row.get("seconds") or {}).get("total")
    return out


def write_results(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    policies = meta["env"]["policies"]
    order = {f: i for i, f in enumerate(meta["families"])}
    rows = sorted(rows, key=lambda r: order.get(r["model_type"], len(order)))
    _atomic(out / "results.json", json.dumps({**meta, "rows": rows}, indent=1, default=str))
    buf = io.StringIO()
    lines = [flat(r, policies) for r in rows]
    writer = csv.DictWriter(buf, fieldnames=list(flat(rows[0], policies)) if rows else ["model_type"])
    writer.writeheader()
    writer.writerows(lines)
    _atomic(out / "results.csv", buf.getvalue())
    _atomic(out / "summary.md", markdown(rows, meta) + "\n")


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    env = meta["env"]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("passed", "refused", "broken")}
    seconds = [r["seconds"].get("total", 0) for r in rows]
    registered = len(meta["families"])
    header = (
        f"Generated by `{meta['command']}` ({env['date']}, transformers {env['transformers']}, torch {env['torch']}, "
        f"CPU {env['cpu']}; policies checked: {', '.join(env['policies']) or 'none'}; estimate = run for "
        f"{', '.join(env['estimate_policies']) or 'none'}; {sum(seconds) / 60:.0f} min, "
        f"{(sum(seconds) / len(seconds) if seconds else 0):.0f} s per family)."
    )
    lines = [
        header,
        "",
        f"**{len(rows)} of {registered} families**: {counts['passed']} passed, {counts['refused']} refused, "
        f"{counts['broken']} broken.",
    ]
    bad = [r for r in rows if r["status"] != "passed"]
    if bad:
        lines += ["", "| family | class | status | reason |", "|---|---|---|---|"]
        for r in sorted(bad, key=lambda r: (r["status"] != "broken", r["model_type"])):
            lines.append(f"| `{r['model_type']}` | {r['class']} | {r['status']} | {_cell(r['reason'])} |")
    passed = [r for r in rows if r["status"] == "passed"]
    if passed:

        def name(r: dict[str, Any]) -> str:
            refused = [p for p, c in r["checks"].items() if c["result"] == "refused"]
            marks = [*(["sdpa"] if r.get("attention") == "sdpa" else []), *(f"no {p}" for p in refused)]
            estimates = r.get("estimate") or {}
            if estimates and all("error" in e for e in estimates.values()):
                marks.append("no estimate")
            return f"`{r['model_type']}`" + (f" ({', '.join(marks)})" if marks else "")

        lines += ["", f"Passed ({len(passed)}): " + ", ".join(name(r) for r in passed) + "."]
        lines += [
            "",
            "Passed: loads through `models.build_model`, every checked policy equal to `none` under `trainer.check` "
            "(bitwise) or refused by the project in one line (marked `no <policy>`), the estimate equal to a real "
            f"run within {ESTIMATE_SLACK_BYTES} B or refused in one line (`no estimate`), and the training loss equal "
            "to the model's own within "
            f"{LOSS_TOLERANCE:g} relative; `sdpa`: no eager attention path, checked with `model.attention=sdpa`.",
        ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# The command line.
# ----------------------------------------------------------------------------------------------------


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from trainer.core.schema import OneLineParser

    ap = OneLineParser(prog=COMMAND, description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--families", type=_names, default=None, help="comma-separated model types (default: every one)")
    ap.add_argument("--policies", type=_names, default=list(POLICIES), help=f"default {','.join(POLICIES)}")
    ap.add_argument(
        "--estimate-policies",
        type=_names,
        default=None,
        help="policies whose estimate is held to a real run (default: none and every checked policy)",
    )
    ap.add_argument("--out", type=Path, default=None, help="results folder (default runs/trainer/families/<stamp>)")
    ap.add_argument("--resume", type=Path, default=None, help="a results folder to go on with (skips its families)")
    ap.add_argument("--render", type=Path, default=None, help="only render an existing results folder")
    ap.add_argument("--jobs", type=int, default=1, help="families at once (default 1)")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help=f"seconds per family (default {TIMEOUT_S:g})")
    ap.add_argument(
        "--memory-mib", type=int, default=MEMORY_MIB, help=f"each family's memory cap in MiB (default {MEMORY_MIB})"
    )
    add_page_arguments(ap, HF_FAMILIES_PAGE, f"the table between {START} and {END}")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child: one family
    ap.add_argument("--row", type=Path, help=argparse.SUPPRESS)  # where the child writes its row
    args = ap.parse_args(argv)
    if args.estimate_policies is None:
        args.estimate_policies = ["none", *(p for p in args.policies if p != "none")]
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs} must be ≥ 1")
    if not args.timeout > 0:
        ap.error(f"--timeout {args.timeout} must be > 0")
    if sum(x is not None for x in (args.out, args.resume, args.render)) > 1:
        ap.error("give one of --out, --resume and --render")
    from trainer.policies import POLICIES as REGISTERED

    for p in (*args.policies, *args.estimate_policies):
        if p not in REGISTERED:
            ap.error(f"unknown policy {p!r}; choose from {', '.join(REGISTERED)}")
    return args


def page_markers_error(path: Path) -> str | None:
    text = path.read_text() if path.is_file() else ""
    if START in text and END in text and text.index(START) < text.index(END):
        return None
    return f"{path} has no {START} … {END} markers; add them where the table goes, then rerun"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """transformers, Lightning and the policies' one-time notices at errors only (they would bury the row in the
    log), restored on the way out."""
    names = (
        "transformers",
        "lightning",
        "lightning.pytorch",
        "lightning.fabric",
        "trainer.policies",
        "lightning.pytorch.utilities.rank_zero",
        "lightning.fabric.utilities.rank_zero",
    )
    levels = {n: logging.getLogger(n).level for n in names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in names:
            logging.getLogger(n).setLevel(logging.ERROR)
        try:
            yield
        finally:
            for n, level in levels.items():
                logging.getLogger(n).setLevel(level)


def child(args: argparse.Namespace) -> int:
    import resource

    import torch

    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = args.memory_mib * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    torch.set_num_threads(1)
    with quiet():
        row = family_row(args.one, args.policies, args.estimate_policies)
    if "traceback" in row:
        print(row["traceback"], file=sys.stderr)
    args.row.parent.mkdir(parents=True, exist_ok=True)
    _atomic(args.row, json.dumps(row, default=str))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        return child(args)

    def log(line: str) -> None:
        print(line, flush=True)

    if args.write_docs:
        problem = page_markers_error(args.page)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    if args.render is not None:
        meta_file = args.render / "meta.json"
        if not meta_file.is_file():
            print(f"error: --render {args.render}: no meta.json there; give a folder this sweep wrote", file=sys.stderr)
            return 2
        meta, rows = json.loads(meta_file.read_text()), read_rows(args.render)
        write_results(args.render, rows, meta)
        out = args.render
    else:
        registered = registered_families()
        families = args.families or registered
        unknown = [f for f in families if f not in registered]
        if unknown:
            print(
                f"error: --families: {', '.join(unknown)} not in transformers' causal-LM registry "
                f"(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, {len(registered)} families)",
                file=sys.stderr,
            )
            return 2
        stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        out = args.resume or args.out or ROOT / "runs" / "families" / stamp
        out.mkdir(parents=True, exist_ok=True)
        log(f"{len(families)} families, {args.jobs} at a time, {args.timeout:g} s each at most → {out}")
        rows = sweep(args, out, families, log)
        meta = json.loads((out / "meta.json").read_text())
    text = (out / "summary.md").read_text()
    print("\n" + text)
    if args.write_docs:
        replace_block(args.page, START, END, text.rstrip("\n"), HEADING)
        print(f"wrote {args.page}", file=sys.stderr)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("passed", "refused", "broken")}
    log(f"{out}: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" (meta {len(meta['families'])} families)")
    return 0
