"""A device mesh over ranks that do not exist: torch's fake process group, for an estimate of one rank of a
multi-rank layout on fake tensors.

    mesh, group = fake_mesh(world=8, device_type="cuda")   # this process: rank 0 of 8
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


def fake_mesh(world: int, device_type: str, dim_name: str = "data_parallel") -> tuple[Any, Any]:
    """A 1-D device mesh over `world` ranks of torch's fake process group (collectives that move nothing), and the
    group to destroy after (`release`). Outside a run, this process becomes rank 0 of a fake default group. Inside a
    run (its own prediction: the default group is the run's), a fake group over the run's ranks, each rank its own
    share; the run's group is left untouched."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("fake", store=_fake_store(), rank=0, world_size=world)
        return init_device_mesh(device_type, (world,), mesh_dim_names=(dim_name,)), dist.GroupMember.WORLD
    if dist.get_world_size() != world:
        raise ConfigError(
            f"trainer=fsdp2 estimate of {world} ranks inside a process group of {dist.get_world_size()}: estimate "
            f"it outside the run (python -m trainer.estimate ... trainer.devices={world})"
        )
    _fake_store()  # importing its module registers the fake backend
    group = dist.new_group(backend="fake")  # every rank predicts, so every rank makes it, in the same order
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=(dim_name,)), group
