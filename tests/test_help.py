"""Every entry point answers `--help`: exit 0, a usage, and a line of help for every option (a test per command,
answered in a fresh interpreter as a user types it). The estimator's help names the catalogue's GPUs and what
`--device cuda` means."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import CLI_ENV, ROOT, run_cli

# Run each module as `python -m MODULE --help` would, after making argparse refuse an option without help text; one
# fresh interpreter answers for every module (each in turn, its own sys.argv and output), so the imports are paid once.
DRIVER = """
import argparse, contextlib, io, json, runpy, sys, traceback
original = argparse.ArgumentParser.print_help
def print_help(self, file=None):
    bare = [a.option_strings or [a.dest] for a in self._actions if not a.help and a.help != argparse.SUPPRESS]
    if bare:
        raise SystemExit(f"options without help: {bare}")
    original(self, file)
argparse.ArgumentParser.print_help = print_help
answers = {}
for module in sys.argv[1:]:
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [module, "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
    answers[module] = {"rc": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
print(json.dumps(answers))
"""


def _bench_commands() -> list[str]:
    """Every benchmark that is a command: a bench module with a __main__ block, or a bench package with __main__.py."""
    found = []
    for path in sorted((ROOT / "bench").iterdir()):
        if path.suffix == ".py" and not path.name.startswith("_") and 'if __name__ == "__main__"' in path.read_text():
            found.append(f"bench.{path.stem}")
        elif path.is_dir() and (path / "__main__.py").exists():
            found.append(f"bench.{path.name}")
    return found


COMMANDS = [
    "trainer.estimate",
    "trainer.export",
    "trainer.check",
    "trainer.report",
    "trainer.report.tensorboard",
    "trainer.families",
    "bench",
    *_bench_commands(),
]


@pytest.fixture(scope="module")
def help_answers() -> dict[str, dict[str, Any]]:
    r = subprocess.run(
        [sys.executable, "-c", DRIVER, *COMMANDS], cwd=ROOT, env=CLI_ENV, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", COMMANDS)
def test_every_command_answers_help(module: str, help_answers: dict[str, dict[str, Any]]) -> None:
    r = help_answers[module]
    assert r["rc"] == 0, r["stderr"][-2000:]
    assert r["stdout"].startswith("usage:"), r["stdout"][:300]
    assert "Traceback" not in r["stderr"], r["stderr"][-2000:]


def test_the_bench_commands_are_found() -> None:
    assert {"bench.policies", "bench.planner", "bench.compiled"} <= set(COMMANDS)


def test_the_bench_runner_lists_every_table_command_and_refuses_an_unknown_one() -> None:
    """`python -m bench` is the one list of tables: every benchmark command is in it (and each entry a command),
    and an unknown table is one error line naming the choices, exit 2."""
    from bench.__main__ import TABLES

    listed = {t.module for t in TABLES.values()}
    assert listed == set(_bench_commands())
    r = subprocess.run([sys.executable, "-m", "bench", "nope"], cwd=ROOT, env=CLI_ENV, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "choose one of policies" in r.stderr


def test_train_py_help_says_how_to_run_and_sweep() -> None:
    r = run_cli("--help")
    assert r.returncode == 0, r.stderr
    assert "python train.py policy=selective accum=8" in r.stdout
    assert "python -m trainer.estimate" in r.stdout and "policy: " in r.stdout  # our header, then Hydra's groups


def test_estimator_help_lists_the_catalogue_and_explains_cuda_without_a_gpu() -> None:
    from trainer.measure.gpus import load_catalogue

    r = subprocess.run(
        [sys.executable, "-m", "trainer.estimate", "--help"], cwd=ROOT, env=CLI_ENV, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    flat = " ".join(r.stdout.split())  # argparse wraps the option texts
    for name in load_catalogue():
        assert name in flat
    assert "--device cuda estimates for a CUDA GPU even on a machine without one" in flat
    assert "1GiB+5%" in flat  # the default that ended --help in a traceback


def test_a_lone_percent_sign_in_a_help_text_is_printed() -> None:
    from trainer.core.schema import OneLineParser

    p = OneLineParser(prog="x")
    p.add_argument("--reserve", default="1GiB+5%", help="keep free (default 1GiB+5%)")
    p.add_argument("--n", default=3, help="n (default %(default)s)")
    text = p.format_help()
    assert "(default 1GiB+5%)" in text and "n (default 3)" in text


def test_a_commands_imports_leave_later_collections_and_its_own_cycles_are_still_collected() -> None:
    """trainer.interpreter.lean_imports, around every command's imports: what the block imported is frozen out of later
    collections, the collector is on again after it, and a cycle the command makes afterwards is still collected (a
    run's own garbage is freed as before), even past a second block that imports nothing new (a sequential sweep's
    next job: its last run's garbage is not frozen); at exit the run's objects are frozen too, and the process ends
    cleanly."""
    code = (
        "import gc\n"
        "from trainer.interpreter import lean_imports\n"
        "with lean_imports():\n"
        "    import json\n"
        "frozen = gc.get_freeze_count()\n"
        "class Cycle:\n"
        "    def __del__(self):\n"
        "        print('collected')\n"
        "c = Cycle()\n"
        "c.me = c\n"
        "del c\n"
        "with lean_imports():\n"
        "    import json\n"
        "print(gc.get_freeze_count() == frozen)\n"
        "gc.collect()\n"
        "print(gc.isenabled(), frozen > 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=CLI_ENV)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "collected", "True", "True"]
