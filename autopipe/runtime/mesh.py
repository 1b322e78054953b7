"""The ranks' layout under torchrun: which ranks form each pipeline (the mesh's ``"pp"`` dim) and the mesh FSDP2
shards and replicates a stage over (``"dp_shard"``, ``"dp_replicate"``, torchtitan's names); the process groups of
tied weights. Every check here runs before any tensor is allocated. docs/architecture.md, "Under torchrun"."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DIMS", "RankLayout", "pipeline_size", "rank_layout", "tie_groups", "describe"]

DIMS = ("dp_replicate", "dp_shard", "pp")  # the order of RankLayout.grid's dims


def pipeline_size(mesh: DeviceMesh | None, world: int, data_parallel: int, balance: Any = None,
                  virtual_stages: int = 1) -> int:
    """K, the ranks of one pipeline: the mesh's ``"pp"`` size, else world / data_parallel. Refuses a mesh without
    ``"pp"``, with a dim autopipe does not know, over other ranks than the world's, or whose pp size does not match
    ``balance``'s stages, naming the dim and both sizes."""
    if mesh is None:
        if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1 \
                or world % data_parallel:
            raise ValueError(f"data_parallel={data_parallel!r} must divide the world size {world}")
        k = world // data_parallel
    else:
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
        names = tuple(mesh.mesh_dim_names or ())
        sizes = dict(zip(names, mesh.mesh.shape))
        if "pp" not in names:
            raise ValueError(f"the mesh has dims {sizes or tuple(mesh.mesh.shape)} but no 'pp' dim: name the "
                             f"pipeline's dim 'pp' (init_device_mesh(..., mesh_dim_names=('pp', 'dp_shard')))")
        unknown = [n for n in names if n not in DIMS]
        if unknown:
            raise ValueError(f"the mesh's dim {unknown[0]!r} (size {sizes[unknown[0]]}) is not one autopipe runs: "
                             f"name its dims among {DIMS}")
        if data_parallel != 1:
            raise ValueError(f"data_parallel={data_parallel} with a mesh: give the replicas as the mesh's "
                             f"'dp_replicate' dim instead")
        if mesh.mesh.numel() != world:
            raise ValueError(f"the mesh {sizes} spans {mesh.mesh.numel()} ranks but the world has {world}: "
                             f"a pipeline's mesh covers every rank")
        k = sizes["pp"]
    if isinstance(balance, (tuple, list)) and len(balance) != k * virtual_stages:
        raise ValueError(f"balance gives {len(balance)} stages but the pipeline has {k * virtual_stages} "
                         f"({'pp' if mesh is not None else 'world / data_parallel'} size {k} x {virtual_stages} "
                         f"virtual stages): give one weight per stage")
    return k


@dataclass
class RankLayout:
    """Where this rank stands: its pipeline (global ranks by pp coordinate), its place in it, and the data-parallel
    mesh FSDP2 runs its stages over (None without data parallelism)."""

    grid: torch.Tensor              # global ranks, (dp_replicate, dp_shard, pp)
    index: int                      # which pipeline (row of the grid flattened to (-1, pp)) is this rank's
    position: int                   # its pp coordinate: the rank of its first stage within the pipeline
    dp_mesh: DeviceMesh | None      # FSDP2's: dp_shard (1-D), or (dp_replicate, dp_shard) (HSDP, replicate-only)

    @property
    def pipelines(self) -> list[list[int]]:
        return self.grid.reshape(-1, self.grid.shape[-1]).tolist()

    @property
    def ranks(self) -> list[int]:
        """This rank's pipeline: global ranks by pp coordinate."""
        return self.pipelines[self.index]

    @property
    def dp_replicate(self) -> int:
        return self.grid.shape[0]

    @property
    def dp_shard(self) -> int:
        return self.grid.shape[1]

    @property
    def data_parallel(self) -> int:
        return self.dp_replicate * self.dp_shard


def _grid(mesh: DeviceMesh | None, world: int, data_parallel: int) -> torch.Tensor:
    """The mesh's ranks as (dp_replicate, dp_shard, pp), a missing dim of size 1; ``data_parallel=D`` is D replicas
    of world / D consecutive ranks each."""
    if mesh is None:
        return torch.arange(world).reshape(data_parallel, 1, world // data_parallel)
    names, ranks = list(mesh.mesh_dim_names), mesh.mesh
    for name in DIMS:
        if name not in names:
            ranks, names = ranks.unsqueeze(-1), [*names, name]
    return ranks.permute(*(names.index(n) for n in DIMS)).contiguous()


def rank_layout(mesh: DeviceMesh | None, data_parallel: int, device_type: str) -> RankLayout:
    """This rank's layout, its data-parallel DeviceMesh made (every rank calls this, in the same order: a mesh makes
    process groups). A mesh on another device type than the stages' is refused."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if mesh is not None and mesh.device_type != device_type:
        raise ValueError(f"the mesh is on {mesh.device_type!r} but this rank's stages run on {device_type!r}: make "
                         f"the mesh with init_device_mesh({device_type!r}, ...), or pass device= to match it")
    grid = _grid(mesh, world, data_parallel)
    flat = grid.reshape(-1, grid.shape[-1])
    index = next(i for i, row in enumerate(flat.tolist()) if rank in row)
    position = flat[index].tolist().index(rank)
    dp_mesh = None
    if grid.shape[0] * grid.shape[1] > 1:
        # the pipelines' stages are the mesh's last dim: each (dp_replicate, dp_shard) slice holds one stage position
        full = DeviceMesh(device_type, grid, mesh_dim_names=DIMS)
        dp_mesh = full["dp_shard"] if grid.shape[0] == 1 else full["dp_replicate", "dp_shard"]
    return RankLayout(grid, index, position, dp_mesh)


def tie_groups(layout: RankLayout, shared: dict[str, tuple[int, ...]],
               rank_of: Callable[[int], int]) -> list[tuple[str, dist.ProcessGroup, list[int]]]:
    """A process group per tied parameter held by several ranks of a pipeline, in every pipeline (every rank creates
    every group, in the same order, as torch.distributed requires): (name, group, ranks) of those this rank is in.
    Under FSDP2 each holder's gradient is its shard of the same rows: the groups join holders at the same dp
    coordinates, which are the same pipeline."""
    mine, rank = [], dist.get_rank()
    for pipeline in layout.pipelines:
        for name, holders in sorted(shared.items()):
            ranks = sorted({pipeline[rank_of(s)] for s in holders})
            if len(ranks) > 1:  # all on one rank: summed there
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine.append((name, group, ranks))
    return mine


def describe(layout: RankLayout) -> str:
    sizes = {"pp": layout.grid.shape[-1], "dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard}
    return " x ".join(f"{n}={s}" for n, s in sizes.items() if s > 1 or n == "pp") + \
        f" ({math.prod(sizes.values())} ranks)"
