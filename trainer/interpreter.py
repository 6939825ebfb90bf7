"""A command's process without the cyclic garbage collector's passes over what its imports built.

    from trainer.interpreter import lean_imports

    with lean_imports():  # first thing in a command's entry point
        from trainer.core.run import train

Importing torch, Lightning, Hydra and transformers builds a few million objects that live until the process ends.
Python's cyclic collector walks every one of them at each full collection the imports trigger, and once more when
the interpreter exits (after the atexit handlers, before the modules are torn down), where nothing it could free
matters any more. For a command that runs for seconds (a smoke run, a test's run, each rank Lightning starts, a
refusal) those passes are a large share of its time. `lean_imports` turns the collector off while its block imports,
then freezes what exists (`gc.freeze`: out of every later collection; what the imports built lives as long as the
process) and turns it back on, so training collects its own cycles as before; at exit it freezes what the run built
too, so the last collection has nothing to walk. What that gives up: an object in a reference cycle is not finalized
at exit (its `__del__`, a weakref callback), so whatever must reach disk is closed where it is written, as here (the
run folder's files atomically, TensorBoard's writer at the run's end, logging by its own atexit handler). A
`python -m trainer.<tool>` command imports its package before its `__main__` runs, so there the block covers only
what the package left to import; its exit is lean all the same.

Near tools: `gc.freeze` is the whole mechanism (Python's own, documented for forking servers); torch has no
equivalent. Known limitations: the cyclic garbage the imports leave is frozen with the rest and never freed (a few MiB
for torch and Lightning), and a library object frozen here and later dropped into a reference cycle is not collected.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import sys
from collections.abc import Iterator

_exit_registered = False


def lean_exit() -> None:
    """At exit, freeze everything first, so the interpreter's last full collection walks nothing. Idempotent; for a
    process that imports on its own (a spawned rank), call it first thing."""
    global _exit_registered
    if not _exit_registered:
        atexit.register(gc.freeze)
        _exit_registered = True


@contextlib.contextmanager
def lean_imports() -> Iterator[None]:
    """Import in the block without the cyclic collector, then freeze what exists and collect as before; `lean_exit`.

    Nothing is frozen when the block imported nothing new: a second run in the same process (Hydra's sequential
    multirun calls train.py's main once per job) must not freeze the last run's garbage, tensors included, for good.
    """
    enabled = gc.isenabled()
    modules = len(sys.modules)
    gc.disable()
    try:
        yield
    finally:
        if len(sys.modules) > modules:
            gc.freeze()
        if enabled:
            gc.enable()
        lean_exit()
