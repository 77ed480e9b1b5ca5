"""Every package installed together, and named meshes over the integration matrix of world sizes and shapes.

Each mesh shape is checked against the single-rank picture: the ranks that share a sub-mesh are exactly the ranks a
single process would compute from the canonical (pp, dp, tp) row-major layout.
"""

from __future__ import annotations

import itertools
import math

import pytest

from vescale.core.testing import imported_vescale_packages, multi_rank

# (world size, mesh) pairs of the matrix: (dp), (tp), (pp), (dp,tp), (pp,dp), (pp,tp), (pp,dp,tp).
SHAPES = [
    (1, {"dp": 1}),
    (2, {"dp": 2}), (2, {"tp": 2}), (2, {"pp": 2}),
    (4, {"dp": 2, "tp": 2}), (4, {"pp": 2, "dp": 2}), (4, {"pp": 2, "tp": 2}), (4, {"tp": 4}),
    (8, {"pp": 2, "dp": 2, "tp": 2}), (8, {"dp": 8}),
]


def test_all_packages_import_together():
    """Every package imports into one fresh interpreter beside the others (one process start instead of six: each
    package alone, with only the siblings it declares, is what its own nox ``tests`` session imports)."""
    subs = ["core", "dtensor", "parallel", "pipe", "checkpoint", "plan"]
    loaded = imported_vescale_packages(", ".join(f"vescale.{sub}" for sub in subs))
    assert set(subs) <= loaded, sorted(set(subs) - loaded)


def _expected_groups(dims: dict[str, int], name: str) -> set[tuple[int, ...]]:
    names = list(dims)
    sizes = [dims[n] for n in names]
    axis = names.index(name)
    groups = set()
    for coord in itertools.product(*[range(s) for s in sizes]):
        members = []
        for i in range(sizes[axis]):
            c = list(coord)
            c[axis] = i
            members.append(sum(ci * math.prod(sizes[k + 1:]) for k, ci in enumerate(c)))
        groups.add(tuple(members))
    return groups


def _check_mesh(dims):
    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh, sub_mesh

    mesh = init_mesh(dims)
    world = dist.get_world_size()
    for name in mesh.mesh_dim_names:
        group = sub_mesh(mesh, name).get_group()
        ranks = sorted(dist.get_process_group_ranks(group))
        # A collective on the sub-mesh reaches exactly its members.
        t = torch.zeros(world)
        t[dist.get_rank()] = 1.0
        dist.all_reduce(t, group=group)
        assert [i for i in range(world) if t[i] == 1.0] == ranks
        assert tuple(ranks) in _expected_groups(dict(zip(mesh.mesh_dim_names, mesh.mesh.shape)), name)


@pytest.mark.parametrize("world_size,dims", SHAPES, ids=[f"ws{w}-" + "x".join(f"{k}{v}" for k, v in d.items())
                                                        for w, d in SHAPES])
def test_mesh_sub_groups_match_single_process_layout(world_size, dims, ranks):
    ranks(_check_mesh, world_size, dims)


@multi_rank(world_sizes=[1, 2, 4, 8])
def test_all_reduce_over_world(world_size):
    import torch
    import torch.distributed as dist

    t = torch.arange(5, dtype=torch.float64) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    assert torch.equal(t, torch.arange(5, dtype=torch.float64) * (world_size * (world_size + 1) / 2))
