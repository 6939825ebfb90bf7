"""A device mesh over ranks that do not exist: torch's fake process group, for an estimate of one rank of a
multi-rank layout on fake tensors.

    mesh, group = fake_mesh(world=8, device_type="cuda")   # this process: rank 0 of 8
    mesh, group = fake_mesh(8, "cuda", tensor_parallel=2)  # data parallel × tensor parallel: 4 × 2
    ...                                                     # fully_shard(model, mesh=mesh) and one step on fakes
    release(group)

torch ships the fake backend (`dist.init_process_group("fake", ...)`: every collective returns at once, moving
nothing, with the output shapes a real one gives) for its own tests: the backend is registered, and its store
`FakeStore` defined, by `torch.testing._internal.distributed.fake_pg` on import, and nowhere public. This module is
the one place that imports it, so a torch that moves it breaks here, with one line naming the cause, and nowhere
else. `torch.distributed._tools.FSDPMemTracker` estimates FSDP2's memory on the same fake group; ours steps the
run's own module instead, so the estimate covers the policy, the loss head and the optimizer as the run does.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

from trainer.errors import ConfigError


def _fake_store() -> Any:
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:  # pragma: no cover - depends on the installed torch
        raise ConfigError(
            f"this torch has no fake process group store ({e}); a multi-rank estimate needs torch's fake backend: "
            "install torch>=2.6"
        ) from e
    return FakeStore()


_SERIAL = itertools.count()


def fake_mesh(world: int, device_type: str, tensor_parallel: int = 1) -> tuple[Any, Any]:
    """A device mesh over `world` ranks of torch's fake process group (collectives that move nothing), and the group
    to destroy after (`release`): 1-D (data parallel), or with `tensor_parallel` > 1 the run's 2-D (data parallel ×
    tensor parallel) of world / tensor_parallel × tensor_parallel ranks. Outside a run, this
    process becomes rank 0 of a fake default group. Inside a run (its own prediction: the default group is the
    run's), fake groups over the run's ranks, each rank its own share; the run's group is left untouched."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    # Names of their own: torch's DeviceMesh equality (and DTensor's cache of sharding decisions, keyed by it) looks at
    # the ranks, the layout and the names, not the process groups, so a fake mesh named as the run's would stand in for
    # it in the run's own later steps, and their collectives would go to a destroyed fake group.
    # And a serial of their own: two estimates in one process (a test's, a tool's) would otherwise make equal
    # meshes, and the second would reuse the first's cached decisions, whose groups `release` destroyed.
    serial = next(_SERIAL)
    shape, names = (world,), (f"estimate_{serial}_data_parallel",)
    if tensor_parallel > 1:
        shape = (world // tensor_parallel, tensor_parallel)
        names = (f"estimate_{serial}_data_parallel", f"estimate_{serial}_tensor_parallel")
    if not dist.is_initialized():
        dist.init_process_group("fake", store=_fake_store(), rank=0, world_size=world)
        return init_device_mesh(device_type, shape, mesh_dim_names=names), dist.GroupMember.WORLD
    if dist.get_world_size() != world:
        raise ConfigError(
            f"trainer=fsdp2 estimate of {world} ranks inside a process group of {dist.get_world_size()}: estimate "
            f"it outside the run (python -m trainer.estimate ... trainer.devices={world})"
        )
    _fake_store()  # importing its module registers the fake backend
    if len(shape) == 1:
        group = dist.new_group(backend="fake")  # every rank predicts, so every rank makes it, in the same order
        return DeviceMesh.from_group(group, device_type, mesh_dim_names=names), group
    # One fake group per mesh dimension over the run's own ranks: what init_device_mesh makes, faked
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override={0: "fake", 1: "fake"})
    return mesh, (mesh.get_group(0), mesh.get_group(1))


@contextlib.contextmanager
def fake_rank(rank: int, world: int) -> Iterator[Any]:
    """This process as rank `rank` of a fake group of `world` (a pipeline rank's estimate: its P2P sends and receives
    go nowhere), destroyed on exit; yields the group to send on. Outside a run, the fake default group (None: the
    default); inside a run (its own prediction), a fake group over its pipeline's ranks: the run's ranks as a
    (world × replicas) mesh, the stages' ranks outermost as the run lays them out, this process rank `rank` of its
    pipeline; the run's groups are left untouched."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("fake", store=_fake_store(), rank=rank, world_size=world)
        try:
            yield None
        finally:
            dist.destroy_process_group()
        return
    from torch.distributed.device_mesh import init_device_mesh

    replicas = dist.get_world_size() // world
    if dist.get_world_size() % world or dist.get_rank() // replicas != rank:
        raise ConfigError(
            f"an estimate of pipeline rank {rank} of {world} inside rank {dist.get_rank()} of {dist.get_world_size()}:"
            " estimate it outside the run (python -m trainer.estimate with the run's overrides)"
        )
    _fake_store()  # importing its module registers the fake backend
    serial = next(_SERIAL)  # names of its own, as fake_mesh's (DeviceMesh equality looks at names, not groups)
    names = (f"estimate_{serial}_pipeline_parallel", f"estimate_{serial}_data_parallel")
    # every rank predicts, so every rank makes the groups, in the same order
    mesh = init_device_mesh("cpu", (world, replicas), mesh_dim_names=names, backend_override={0: "fake", 1: "fake"})
    try:
        yield mesh.get_group(0)
    finally:
        release((mesh.get_group(0), mesh.get_group(1)))


def release(group: Any) -> None:
    """Destroy what `fake_mesh` made (its group, or its groups), so a later estimate, or a run, makes its own."""
    import torch.distributed as dist

    if group is None or not dist.is_initialized():
        return
    for g in group if isinstance(group, tuple) else (group,):
        dist.destroy_process_group(g)


@contextlib.contextmanager
def real_mesh_arithmetic() -> Iterator[None]:
    """Let a DeviceMesh be made inside a FakeTensorMode. torch computes a mesh's rank tensor with tensor ops, which
    the mode intercepts and refuses (real inputs); FSDP2 over a tensor-parallel mesh makes one inside fully_shard
    (`DeviceMesh._concatenate` of the data- and tensor-parallel meshes). Those few integer ops run outside the mode
    here, and only while this is entered: what the estimate builds on fake tensors stays fake."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__dict__["_concatenate"]

    def concatenate(meshes: list[Any]) -> Any:
        with unset_fake_temporarily():
            return original.__func__(meshes)

    DeviceMesh._concatenate = staticmethod(concatenate)  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh._concatenate = original  # type: ignore[method-assign]
