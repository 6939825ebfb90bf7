"""Measuring activation memory: a live-tensor tracker that works on any device, plus CUDA allocator counters.

One library for the measuring callback, the estimator's tests and the benchmark, so that every figure the
project reports comes from the same bookkeeping.

Why a dispatch mode and not ``saved_tensors_hooks``: the hooks only see what autograd saves *outside*
checkpoint regions. They miss what a checkpoint's recompute holds during backward and never see the cache
of selective activation checkpointing, so they report SAC as if it were full recompute. A dispatch mode
sees every tensor that every op creates, including recompute and the SAC cache, and a weakref on each
storage tells when the bytes are given back.

Near tool: `torch.distributed._tools.MemTracker`, also a dispatch mode with weakrefs on storages, attributes memory
to modules and categories (parameters, gradients, activations, optimizer state) over everything alive. Ours counts a
window (what the step adds over what existed before it), labels storages by the block region that made them (the
planner's per-block profile), records a timeline, can be entered and left from two Lightning hooks, and is the same
bookkeeping on real and fake tensors, so a run's figure and the estimator's are one count.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from trainer.formatting import MIB

FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER = "optimizer"  # clipping and the optimizer step: after backward, outside autograd (set by callers)


class TimelinePoint(NamedTuple):
    """Live bytes right after one op; ``phase`` is "backward" when the op ran inside the autograd engine."""

    op_index: int
    live_bytes: int
    phase: str
    op_name: str


class _Window:
    """Bookkeeping for one enter/exit window.

    Kept apart from the mode object so that storages outliving the window (a parameter's .grad lives on
    into the next step) only hold a weak reference to it: their free callbacks become no-ops once nobody
    needs the window's figures any more, and a re-entered tracker starts clean instead of being
    decremented by last window's frees.
    """

    def __init__(self) -> None:
        # Storage identity is the StorageImpl address (``_cdata``), not ``data_ptr``: views, detach() and
        # in-place results share the StorageImpl, a resize keeps it while moving the data, and meta tensors
        # all have data_ptr 0 yet distinct StorageImpls.
        self.live: dict[int, tuple[int, int, weakref.ref]] = {}  # cdata -> (record id, nbytes, weakref)
        self.next_record = 0
        # (record id, signed byte delta) in the order things happened; replayed by peak_bytes_excluding.
        self.events: list[tuple[int, int]] = []
        self.adopted: set[int] = set()  # records of storages that predate the window (see adopt())
        self.labels: dict[int, str] = {}  # record id -> what made it (the tracker's `region`, or adopt's label)
        self.live_bytes = 0
        self.peak_bytes = 0
        # The autograd engine may run backward on its own thread (CUDA) and storages may die there.
        self.lock = threading.RLock()
        # What each free callback holds: a weak reference, so leftover storages don't pin the window.
        self.weak_self = weakref.ref(self)

    def add(self, delta: int, record: int) -> None:
        with self.lock:
            self.events.append((record, delta))
            self.live_bytes += delta
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes


def _on_storage_freed(window_ref: weakref.ref, cdata: int, record: int) -> None:
    window = window_ref()
    if window is None:
        return
    with window.lock:
        entry = window.live.get(cdata)
        # The address may already belong to a newer storage only if this callback were late; check the
        # record id so a late callback can never subtract someone else's bytes.
        if entry is None or entry[0] != record:
            return
        del window.live[cdata]
        window.add(-entry[1], record)


class LiveTensorTracker(TorchDispatchMode):
    """Tracks bytes of tensor storages CREATED while the mode is active, minus those freed since.

    Gives the true peak over forward + backward, including what checkpoint recompute and SAC caches hold,
    which saved_tensors_hooks cannot see. Storages that existed before the window (parameters, the input
    batch) are not counted: the figures are what the step itself adds.

    Enter it OUTSIDE any checkpoint region: the checkpoint and SAC modes pushed later sit above it on the
    mode stack and forward their ops to it. Usable as ``with LiveTensorTracker() as t:`` or as
    ``t.__enter__()`` / ``t.__exit__(None, None, None)`` from two hooks, as long as the mode stack is
    balanced in between (checked on exit). Each enter starts a fresh window.

    Costs Python work per op: meant for chosen steps, not every step of a timed run.
    """

    def __init__(self, record_timeline: bool = False, device: str | torch.device | None = None) -> None:
        super().__init__()
        self.record_timeline = record_timeline
        # Count only storages of this device type, so e.g. activations offloaded to CPU don't count as
        # accelerator memory.
        self.device_type: str | None = None if device is None else torch.device(device).type
        self.timeline: list[TimelinePoint] = []
        self._window = _Window()
        self._op_index = 0
        self._active = False
        # What is running now (e.g. "layer 3", "head"): storages created meanwhile carry it, for `live_by_label`.
        self.region = ""

    # -- mode protocol ---------------------------------------------------------------------------------

    def __enter__(self) -> LiveTensorTracker:
        if self._active:
            raise RuntimeError("LiveTensorTracker is already active; use a second tracker to nest")
        self._window = _Window()
        self.timeline = []
        self._op_index = 0
        self._active = True
        super().__enter__()
        _activate(self)
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        # TorchDispatchMode.__exit__ pops whatever mode is on top; exiting from a callback hook with some
        # other mode still pushed would silently pop that one instead and leave us active.
        top = _get_current_dispatch_mode()
        if top is not self:
            raise RuntimeError(
                f"LiveTensorTracker exited while {type(top).__name__} is the innermost dispatch mode; "
                "modes entered after the tracker must be exited first"
            )
        super().__exit__(exc_type, exc_val, exc_tb)
        self._active = False
        _deactivate(self)

    def _storage_resized(self, storage: Any, before: int) -> None:
        """A storage changed size outside any op (UntypedStorage.resize_: FSDP2 frees an unsharded parameter with
        resize_(0) and all-gathers into it again after resize_(n)). A tracked storage moves by the difference; an
        untracked one growing from empty is an allocation in the window, from now on tracked."""
        if self.device_type is not None and storage.device.type not in (self.device_type, "meta"):
            return
        window = self._window
        nbytes = storage.nbytes()
        with window.lock:
            entry = window.live.get(storage._cdata)
            if entry is not None:
                window.live[storage._cdata] = (entry[0], nbytes, entry[2])
                window.add(nbytes - entry[1], entry[0])
                return
            if before != 0 or nbytes == 0:
                return  # bytes from before the window (never counted) changing size
            record = window.next_record
            window.next_record += 1
            cdata = storage._cdata
            ref = weakref.ref(storage, lambda _r, w=window.weak_self, c=cdata, rec=record: _on_storage_freed(w, c, rec))
            window.live[cdata] = (record, nbytes, ref)
            if self.region:
                window.labels[record] = self.region
            window.add(nbytes, record)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._count(func, args, kwargs, out)
        return out

    def _count(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Count the storages `func` made for `out`."""
        window = self._window
        input_storages: set[int] | None = None
        for t in local_tensors(tree_flatten(out)[0]):
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                # Wrapper subclasses (DTensor, ...) have no storage of their own; their inner ops are not
                # seen by a mode that sits below them.
                continue
            # The tensor's device, not its storage's: a fake tensor's storage is on "meta", the tensor on its device.
            if self.device_type is not None and t.device.type != self.device_type:
                continue
            cdata = storage._cdata
            nbytes = storage.nbytes()
            with window.lock:
                entry = window.live.get(cdata)
                if entry is not None:
                    # A view, an in-place or out= result: the storage is counted already, but an out= op
                    # may have resized it.
                    if entry[1] != nbytes:
                        window.live[cdata] = (entry[0], nbytes, entry[2])
                        window.add(nbytes - entry[1], entry[0])
                    continue
                if input_storages is None:
                    input_storages = _storages_of((args, kwargs))
                if cdata in input_storages:
                    # An op handing back (a view of) one of its inputs that predates the window.
                    continue
                record = window.next_record
                window.next_record += 1
                # The callback must not reference the storage (that would keep it alive forever).
                ref = weakref.ref(
                    storage,
                    lambda _r, w=window.weak_self, c=cdata, rec=record: _on_storage_freed(w, c, rec),
                )
                # Zero-byte storages are tracked too (no bytes yet) so a later resize_ / out= is counted.
                window.live[cdata] = (record, nbytes, ref)
                if self.region:
                    window.labels[record] = self.region
                window.add(nbytes, record)
        if self.record_timeline:
            phase = BACKWARD if torch._C._current_autograd_node() is not None else FORWARD
            self.timeline.append(TimelinePoint(self._op_index, window.live_bytes, phase, str(func)))
        self._op_index += 1

    # -- figures ---------------------------------------------------------------------------------------

    @property
    def live_bytes(self) -> int:
        return self._window.live_bytes

    @property
    def peak_bytes(self) -> int:
        return self._window.peak_bytes

    def adopt(self, tensors: Iterable[torch.Tensor | None], label: str = "adopted") -> int:
        """Count storages that already exist (parameters, optimizer state, last step's gradients) from now on.

        Their bytes join `live_bytes` and leave it when they are freed inside the window (e.g. gradients set
        to None by zero_grad), so `peak_bytes` becomes the step's whole peak, not only what it added.
        `peak_bytes_excluding` leaves adopted storages out. Call while active. Returns the bytes adopted.
        """
        if not self._active:
            raise RuntimeError("adopt() needs an active tracker")
        window = self._window
        adopted = 0
        for t in local_tensors(tensors):
            storage = t.untyped_storage()
            if self.device_type is not None and t.device.type != self.device_type:
                continue
            cdata = storage._cdata
            with window.lock:
                if cdata in window.live:
                    continue
                record = window.next_record
                window.next_record += 1
                ref = weakref.ref(
                    storage, lambda _r, w=window.weak_self, c=cdata, rec=record: _on_storage_freed(w, c, rec)
                )
                window.live[cdata] = (record, storage.nbytes(), ref)
                window.adopted.add(record)
                window.labels[record] = label
                window.add(storage.nbytes(), record)
                adopted += storage.nbytes()
        return adopted

    def mark(self) -> int:
        """A point in the window (e.g. the end of backward) to bound `peak_bytes_excluding(..., until=mark)`."""
        with self._window.lock:
            return len(self._window.events)

    def peak_bytes_excluding(self, tensors: Iterable[torch.Tensor | None], until: int | None = None) -> int:
        """Peak live bytes had the storages of ``tensors`` — and every adopted storage — never been allocated.

        Only storages created in the window and still alive can be matched, e.g. the parameters' .grad
        tensors a backward creates: "activation peak" = peak excluding gradient buffers. ``None`` entries
        are skipped so ``[p.grad for p in model.parameters()]`` works with frozen parameters. ``until`` (from
        `mark()`) ends the replay there, e.g. before the optimizer step.
        """
        window = self._window
        with window.lock:
            excluded = set(window.adopted)
            for t in local_tensors(tensors):
                entry = window.live.get(t.untyped_storage()._cdata)
                if entry is not None:
                    excluded.add(entry[0])
            events = list(window.events[:until])
        live = peak = 0
        for record, delta in events:
            if record in excluded:
                continue
            live += delta
            peak = max(peak, live)
        return peak

    def records_of(self, tensors: Iterable[torch.Tensor | None]) -> set[int]:
        """Record ids of the live storages of `tensors` (e.g. the parameters' gradients made in the window)."""
        window = self._window
        out = set()
        with window.lock:
            for t in local_tensors(tensors):
                entry = window.live.get(t.untyped_storage()._cdata)
                if entry is not None:
                    out.add(entry[0])
        return out

    def relabel(self, records: Iterable[int], label: str) -> None:
        with self._window.lock:
            for r in records:
                self._window.labels[r] = label

    def live_by_label(self, at: int | None = None, excluding: Iterable[int] = ()) -> dict[str, int]:
        """Live bytes per label after the first `at` events (all of them: None), leaving out `excluding` records."""
        window = self._window
        skip = set(excluding)
        with window.lock:
            events = list(window.events[:at])
            labels = dict(window.labels)
        live: dict[str, int] = {}
        for record, delta in events:
            if record in skip:
                continue
            label = labels.get(record, "other")
            live[label] = live.get(label, 0) + delta
        return {k: v for k, v in live.items() if v}

    def peak_at(self, excluding: Iterable[int] = (), since: int = 0, until: int | None = None) -> tuple[int, int]:
        """(peak live bytes, number of events up to and including the peak) over events[since:until], leaving out
        `excluding` records (their bytes never count, before `since` either)."""
        window = self._window
        skip = set(excluding)
        with window.lock:
            events = list(window.events[:until])
        live = sum(d for r, d in events[:since] if r not in skip)
        peak, where = live, since
        for n, (record, delta) in enumerate(events[since:], start=since + 1):
            if record in skip:
                continue
            live += delta
            if live > peak:
                peak, where = live, n
        return peak, where

    def timeline_json(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "live_bytes": self.live_bytes,
            "num_ops": self._op_index,
            "points": [p._asdict() for p in self.timeline],
        }

    def save_timeline(self, path_json: str | Path, path_png: str | Path | None = None) -> None:
        path_json = Path(path_json)
        path_json.parent.mkdir(parents=True, exist_ok=True)
        path_json.write_text(json.dumps(self.timeline_json()))
        if path_png is not None:
            plot_timeline(self.timeline, self.peak_bytes, path_png)


def local_tensors(tensors: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors that own storage among `tensors` (non-tensors and None dropped): a tensor itself, or a wrapper
    subclass's inner tensors, e.g. a DTensor's local shard (a DTensor's own untyped_storage() reports the global
    size, which would count a rank's FSDP2 shard as the whole parameter)."""
    out: list[torch.Tensor] = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            out += local_tensors(getattr(t, n) for n in names)
        else:
            out.append(t)
    return out


_ACTIVE: list[LiveTensorTracker] = []
_LOCK = threading.Lock()
_storage_resize = torch.UntypedStorage.resize_


def _tracked_resize(storage: Any, size: int) -> Any:
    before = storage.nbytes()
    out = _storage_resize(storage, size)
    for tracker in list(_ACTIVE):
        tracker._storage_resized(storage, before)
    return out


# A storage's resize_ is no op of the dispatcher, so no TorchDispatchMode sees it. Like torch's own MemTracker, the
# trackers wrap `UntypedStorage.resize_` only while one is active: the first to enter installs the wrapper, the last
# to exit restores torch's method, so a process that never tracks runs torch untouched.
def _activate(tracker: LiveTensorTracker) -> None:
    with _LOCK:
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _tracked_resize  # type: ignore[method-assign]
        _ACTIVE.append(tracker)


def _deactivate(tracker: LiveTensorTracker) -> None:
    with _LOCK:
        if tracker in _ACTIVE:
            _ACTIVE.remove(tracker)
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _storage_resize  # type: ignore[method-assign]


def _storages_of(tree: Any) -> set[int]:
    found = set()
    for x in local_tensors(tree_flatten(tree)[0]):
        if isinstance(x, torch.Tensor):
            try:
                found.add(x.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError):
                continue
    return found


def plot_timeline(
    points: list[TimelinePoint],
    peak_bytes: int,
    path: str | Path,
    title: str = "",
    baseline_bytes: int | None = None,
) -> None:
    """Live MiB against op index; each run of non-forward ops (backward, optimizer) shaded in its colour.

    Figure + Agg canvas rather than pyplot: no global backend switch and no shared pyplot state, so a plot written
    from a training callback cannot disturb anyone else's figures.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([p.op_index for p in points], [p.live_bytes / MIB for p in points], lw=1.0, color="tab:blue")
    colours = {BACKWARD: "tab:orange", OPTIMIZER: "tab:green"}
    i = 0
    while i < len(points):  # one shaded span per run of same-phase ops
        j = i
        while j + 1 < len(points) and points[j + 1].phase == points[i].phase:
            j += 1
        if points[i].phase in colours:
            ax.axvspan(points[i].op_index, points[j].op_index, color=colours[points[i].phase], alpha=0.15, lw=0)
        i = j + 1
    ax.axhline(peak_bytes / MIB, color="tab:red", ls="--", lw=0.8, label=f"peak {peak_bytes / MIB:.2f} MiB")
    if baseline_bytes is not None:
        label = f"training state {baseline_bytes / MIB:.2f} MiB"
        ax.axhline(baseline_bytes / MIB, color="grey", ls=":", lw=0.8, label=label)
    shaded = " and ".join(
        f"{ph} {c.removeprefix('tab:')}" for ph, c in colours.items() if any(p.phase == ph for p in points)
    )
    ax.set_title(f"live tensor memory{', ' + title if title else ''}" + (f" (shaded: {shaded})" if shaded else ""))
    ax.set_xlabel("op index")
    ax.set_ylabel("MiB")
    ax.legend(loc="upper left")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def cuda_memory_counters(device: int | str | torch.device | None = None) -> dict[str, float]:
    """Allocator peaks since the last reset, in MiB, plus retries and OOMs; {} without CUDA."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats(device)
    return {
        "peak_allocated_mib": torch.cuda.max_memory_allocated(device) / MIB,
        "peak_reserved_mib": stats.get("reserved_bytes.all.peak", 0) / MIB,
        # Retries mean the allocator had to flush its cache to satisfy a request: the run is close to
        # the memory limit even if it never OOMs.
        "alloc_retries": float(stats.get("num_alloc_retries", 0)),
        "num_ooms": float(stats.get("num_ooms", 0)),
        # The pinned host allocator's bytes handed out at most (policy=offload's copies), not its cache.
        "host_pinned_peak_mib": torch.cuda.host_memory_stats().get("active_bytes.peak", 0) / MIB,
    }


def reset_cuda_peaks(device: int | str | torch.device | None = None) -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_peak_host_memory_stats()
