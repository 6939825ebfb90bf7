"""One family's row: loads, loss = the model's own, trainer.check per policy, estimate = run, in a child process."""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from trainer.families.configs import OVERRIDES, default_config, non_text_reason, tiny_config

POLICIES = ("full", "selective", "op_sac", "sqrt", "every_k")
ESTIMATE_POLICIES = ("none", *POLICIES)
LOSS_TOLERANCE = 1e-5  # relative, fp32
LOGIT_GAIN = 50.0  # the output projection scaled for the loss comparison (random init gives logits of ±0.5)
ESTIMATE_SLACK_BYTES = 64  # tests/test_estimate.py's bound: the run holds one of Lightning's scalars more
TIMEOUT_S = 300.0  # a hybrid's estimate on fake tensors takes ~25 s a policy here (zamba: 3 min in all)
STAGE_MARK = "hf_families stage: "
MAX_PARAMS = 5_000_000  # a tiny config above this missed a size field (every family's is below 1M today)
MEMORY_MIB = 4096  # the child's data segment: a family that runs away fails alone, on a shared machine

# ----------------------------------------------------------------------------------------------------
# One family, through the project's entry points.
# ----------------------------------------------------------------------------------------------------


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def classify(e: BaseException) -> tuple[str, str]:
    """("refused", its one line) for the project's user errors (`describe_user_error` knows them), else ("broken",
    "Type: first line")."""
    from trainer.core.schema import describe_user_error

    line = describe_user_error(e)
    if line is not None:
        return "refused", " ".join(line.split())
    return "broken", f"{type(e).__name__}: {_first_line(e)}"


def overrides_for(folder: Path, attention: str, *extra: str) -> list[str]:
    """The command line a user would give train.py for this folder (byte tokens fit the 320-id vocabulary)."""
    return [
        "model=hf",
        f"model.name_or_path={folder}",
        f"model.attention={attention}",
        "data.tokenizer=byte",
        "seq_len=32",
        "batch_size=2",
        "precision=32-true",
        "trainer.enable_progress_bar=false",
        *extra,
    ]


# tests/test_estimate.py's run: two steps, the second measured
RUN = [
    "trainer.max_steps=2",
    "trainer.enable_checkpointing=false",
    "trainer.val_batches=1",
    "measure.warmup_steps=1",
    "measure.activation_every_n_steps=1",
]


def empty_row(model_type: str) -> dict[str, Any]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {
        "model_type": model_type,
        "class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "?"),
        "status": "passed",
        "stage": "",  # where a refused or broken row stopped
        "loads": False,
        "attention": None,
        "n_layer": None,
        "params": None,
        "checks": {},  # policy: {"result": bitwise | within … | differs | refused | broken, "detail": …}
        "estimate": {},  # policy: {"activation_bytes", "activation_off", "peak_bytes", "peak_off"} or {"error"}
        "loss": {},  # {"ours", "own", "rel_diff", "labels"} or {"error"}
        "reason": "",
        "notes": [],
        "tiny": {},  # the fields changed from the family's defaults
        "seconds": {},
    }


class FamilyRun:
    """One family's stages, each filling its part of the row; the first refusal or failure names the row."""

    def __init__(self, model_type: str, workdir: Path) -> None:
        self.model_type, self.workdir = model_type, workdir
        self.row = empty_row(model_type)
        self.folder = workdir / "model"
        self.attention = "eager"

    def fail(self, stage: str, status: str, reason: str, tb: bool = False) -> None:
        row = self.row
        if row["status"] == "passed" or (row["status"] == "refused" and status == "broken"):
            row["status"], row["stage"], row["reason"] = status, stage, f"{stage}: {reason}"
        if tb and status == "broken":
            row.setdefault("traceback", traceback.format_exc())

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a stage; an exception in it is the row's refusal or failure, and ends the stage."""
        start = time.perf_counter()
        print(f"{STAGE_MARK}{name}", file=sys.stderr, flush=True)  # the log says where a family that hangs hung
        try:
            yield
        except Exception as e:
            status, line = classify(e)
            self.fail(name, status, line, tb=True)
            raise _Stop from None
        finally:
            self.row["seconds"][name] = round(time.perf_counter() - start, 2)

    def compose(self, *extra: str) -> Any:
        from trainer.core.schema import compose_config

        return compose_config(overrides_for(self.folder, self.attention, *extra))

    def config(self) -> bool:
        """The tiny config, saved; False when the family needs more than text (refused on its defaults) or its own
        forward fails on the tiny config (broken: the sweep's shrink or transformers, not the project)."""
        import torch
        import transformers

        values, why = OVERRIDES.get(self.model_type, ({}, ""))
        if values is None:
            self.fail("inputs", "refused", f"{self.row['class']}: {why}")
            return False
        defaults = default_config(self.model_type)
        reason = non_text_reason(self.model_type, self.row["class"], defaults)
        if reason:
            self.fail("inputs", "refused", reason)
            return False
        config, changed = tiny_config(self.model_type, defaults)
        self.row["tiny"] = {k: v for k, v in changed.items() if not isinstance(v, dict)}
        if values:
            self.row["notes"].append(f"override {values}: {why}")
        with torch.device("meta"):  # nothing allocated: a size the shrink missed must not take the machine's memory
            params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        if params > MAX_PARAMS:
            raise ValueError(f"the tiny config still has {params:,} parameters (> {MAX_PARAMS:,}): a missed size")
        try:  # transformers alone, no project code: what fails here is the tiny config's (or transformers') fault
            torch.manual_seed(0)
            own = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config))
            x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
            own(input_ids=x, labels=x, use_cache=False).loss.backward()
        except Exception as e:
            self.fail(
                "tiny config", "broken", f"the model's own forward fails on it: {type(e).__name__}: {_first_line(e)}"
            )
            self.row["traceback"] = traceback.format_exc()
            return False
        config.save_pretrained(self.folder)
        return True

    def load(self) -> None:
        """`models.build_model` on the composed config; no eager attention path: again with sdpa."""
        from models import build_model
        from models.adapter import adapter_for
        from trainer.core import build

        try:
            cfg = self.compose()
            model = build_model(cfg.model, vocab_size=build.vocab(cfg), hf_config=build.hf_config(cfg))
        except Exception as e:
            status, line = classify(e)
            if status != "refused" or "no eager attention path" not in line:
                raise
            self.row["notes"].append("no eager attention path: model.attention=sdpa")
            self.attention = "sdpa"
            cfg = self.compose()
            model = build_model(cfg.model, vocab_size=build.vocab(cfg), hf_config=build.hf_config(cfg))
        adapter = adapter_for(model)
        self.row.update(loads=True, attention=self.attention, n_layer=adapter.n_layer, params=adapter.num_parameters())
        self.row["class"] = type(model).__name__

    def loss(self) -> None:
        """`DecoderModule.loss_of((x, y))` against `model(input_ids=x, labels=x).loss`, dropout 0, eval()."""
        import torch

        from trainer.core import build

        cfg = self.compose("model.dropout=0.0")
        torch.manual_seed(cfg.seed)
        module = build.module(cfg, "none", vocab_size=build.vocab(cfg), hf_config=build.hf_config(cfg)).eval()
        x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        y = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
        with torch.no_grad():
            module.adapter.head.weight.mul_(LOGIT_GAIN)  # logits of tens: a softcap or scale after the head shows
            ours = float(module.loss_of((x, y)))
            own = float(module.model(input_ids=x, labels=x, use_cache=False).loss)
            rel = abs(ours - own) / max(abs(own), 1e-12)
            self.row["loss"] = {"ours": ours, "own": own, "rel_diff": rel, "labels": "x"}
            if not rel <= LOSS_TOLERANCE:  # some causal LMs (BART's decoder) take their labels already shifted
                pre = float(module.model(input_ids=x, labels=y, use_cache=False).loss)
                if abs(ours - pre) <= LOSS_TOLERANCE * max(abs(pre), 1e-12):
                    rel = abs(ours - pre) / max(abs(pre), 1e-12)
                    self.row["loss"].update(own=pre, rel_diff=rel, labels="shifted")
                    self.row["notes"].append(f"{self.row['class']} does not shift its labels: compared with labels=y")
        if not rel <= LOSS_TOLERANCE:
            self.fail(
                "loss", "broken", f"the training loss {ours:.6g} ≠ the model's own {own:.6g} ({rel:.3g} relative)"
            )

    def check(self, policy: str) -> None:
        """`trainer.check.compare.run_check`: 2 steps of the policy against `none` (bitwise on CPU)."""
        from trainer.check import run_check

        try:
            result = run_check(self.compose(f"policy={policy}"), steps=2)
        except Exception as e:
            status, line = classify(e)
            self.row["checks"][policy] = {"result": status, "detail": line}
            if status == "refused":
                self.row["notes"].append(f"{policy} refused: {line}")
                return
            raise
        if result.equal:
            how = "bitwise" if result.exact else f"within {result.tolerance:g}"
            self.row["checks"][policy] = {"result": how, "detail": result.plan}
        else:
            self.row["checks"][policy] = {"result": "differs", "detail": result.first_failure}
            self.fail(f"check {policy}", "broken", f"differs from none: {result.first_failure}")

    def estimate(self, policy: str) -> None:
        """`trainer.estimate.measure` against a real `trainer.core.run.train` run of the same config."""
        from trainer.core.run import train
        from trainer.estimate import measure, open_session
        from trainer.formatting import MIB
        from trainer.policies import build_policy

        try:
            cfg = self.compose(f"policy={policy}", *RUN)
            est = measure(open_session(cfg), build_policy(cfg.policy))
            summary = train(self.compose(f"policy={policy}", *RUN), self.workdir / f"run-{policy}")
        except Exception as e:
            status, line = classify(e)
            self.row["estimate"][policy] = {"error": line}
            if status == "refused":
                self.row["notes"].append(f"estimate {policy} refused: {line}")
                return
            raise
        act = est.activation_bytes - round(summary["activation_peak_mib"] * MIB)
        peak = est.peak_bytes - round(summary["peak_total_mib"] * MIB)
        self.row["estimate"][policy] = {
            "activation_bytes": est.activation_bytes,
            "activation_off": act,
            "peak_bytes": est.peak_bytes,
            "peak_off": peak,
        }
        if max(abs(act), abs(peak)) > ESTIMATE_SLACK_BYTES:
            self.fail(f"estimate {policy}", "broken", f"estimate ≠ run: activation {act:+,} B, peak {peak:+,} B")

    def run(self, policies: Sequence[str], estimate_policies: Sequence[str]) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            with self.stage("tiny config"):
                if not self.config():
                    return self.row
            with self.stage("load"):
                self.load()
            # From here on a stage that fails leaves the others to run: the row shows everything that differs.
            for name, step in [
                ("loss", self.loss),
                *((f"check {p}", functools.partial(self.check, p)) for p in policies),
                *((f"estimate {p}", functools.partial(self.estimate, p)) for p in estimate_policies),
            ]:
                with contextlib.suppress(_Stop), self.stage(name):
                    step()
            checks = self.row["checks"]
            if checks and all(c["result"] == "refused" for c in checks.values()):
                details = sorted({c["detail"] for c in checks.values()})
                self.fail("check", "refused", "every policy refused: " + " | ".join(details))
        except _Stop:
            pass
        finally:
            self.row["seconds"]["total"] = round(time.perf_counter() - t0, 2)
        return self.row


class _Stop(Exception):
    """A stage failed; its row says how."""


def family_row(
    model_type: str,
    policies: Sequence[str] = POLICIES,
    estimate_policies: Sequence[str] = ESTIMATE_POLICIES,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """One family's row (see the module doc). Never raises for the family's own failures: they are the row."""
    if workdir is not None:
        return FamilyRun(model_type, Path(workdir)).run(policies, estimate_policies)
    with tempfile.TemporaryDirectory(prefix=f"hf-{model_type}-") as tmp:
        return FamilyRun(model_type, Path(tmp)).run(policies, estimate_policies)
