"""vescale.core.MeshRoles: which ranks play which role, from the mesh alone, on several mesh shapes."""

from __future__ import annotations

import pytest

from vescale.core.errors import MeshError
from vescale.core.mesh import batch_size_of, hsdp_pair
from vescale.core.testing import multi_rank


def test_one_rank_has_every_role_of_size_one():
    import torch

    from vescale.core.mesh import MeshRoles

    roles = MeshRoles.of(None)
    for name in ("batch", "dense_grads", "expert_grads", "pp", "dp", "cp", "ep", "tp"):
        role = getattr(roles, name)
        assert (role.size, role.rank, role.mesh, role.group) == (1, 0, None, None) and not role, name
    batch = torch.arange(6).view(3, 2)
    assert roles.shard_batch(batch) is batch and roles.model is None and roles.fsdp is None


def test_pure_helpers_need_no_mesh():
    assert batch_size_of({"pp": 2, "dp": 2, "ep": 3, "tp": 2}) == 6
    assert batch_size_of({"dp_replicate": 2, "dp_shard": 4, "tp": 2}) == 8
    assert hsdp_pair(("pp", "dp_replicate", "dp_shard")) == ("dp_replicate", "dp_shard")
    assert hsdp_pair(("dp", "tp")) is None
    for bad in (("dp_shard",), ("dp", "dp_replicate", "dp_shard")):
        with pytest.raises(MeshError, match="HSDP names both"):
            hsdp_pair(bad)


def _ranks(role) -> list[int]:
    import torch.distributed as dist

    return dist.get_process_group_ranks(role.group) if role.group is not None else [dist.get_rank()]


@pytest.mark.parametrize("dims, want", [
    # rank r of a pp=2,dp=2,tp=2 mesh: pp = r // 4, dp = (r // 2) % 2, tp = r % 2
    ({"pp": 2, "dp": 2, "tp": 2}, {"batch": ("dp",), "dense_grads": ("dp",), "model": ("tp",)}),
    ({"dp": 2, "ep": 2, "tp": 2}, {"batch": ("dp", "ep"), "dense_grads": ("dp", "ep"), "expert_grads": ("dp",),
                                   "model": ("ep", "tp")}),
    ({"dp": 2, "cp": 2, "tp": 2}, {"batch": ("dp",), "dense_grads": ("dp", "cp"), "expert_grads": ("dp", "cp"),
                                   "fsdp": ("dp", "cp"),
                                   "model": ("tp",)}),
    ({"dp_replicate": 2, "dp_shard": 2, "tp": 2}, {"batch": ("dp_replicate", "dp_shard"),
                                                   "fsdp": ("dp_replicate", "dp_shard"), "model": ("tp",)}),
])
@multi_rank(world_sizes=[8])
def test_roles_span_the_ranks_the_mesh_says(dims, want):
    import torch
    import torch.distributed as dist

    from vescale.core.mesh import MeshRoles, init_mesh, mesh_coordinates

    mesh = init_mesh(dims)
    roles = MeshRoles.of(mesh)
    at = mesh_coordinates(mesh)
    names = list(mesh.mesh_dim_names)
    sizes = dict(zip(names, mesh.shape))

    def expected(role_dims: tuple[str, ...]) -> tuple[list[int], int]:
        """Ranks sharing every other coordinate, and this rank's index among them (mesh order, row-major)."""
        members = []
        for r in range(dist.get_world_size()):
            coord, rest = {}, r
            for n in reversed(names):
                coord[n], rest = rest % sizes[n], rest // sizes[n]
            if all(coord[n] == at[n] for n in names if n not in role_dims):
                members.append(r)
        return members, members.index(dist.get_rank())

    for name in ("batch", "dense_grads", "expert_grads"):
        role = getattr(roles, name)
        role_dims = want.get(name, tuple(n for n in want.get("batch", ()) if n != "ep"))
        members, index = expected(role_dims)
        assert role.dims == role_dims and role.size == len(members) and role.rank == index, (name, role)
        assert _ranks(role) == members, name
    if "fsdp" in want:
        fsdp = roles.fsdp
        got = dist.get_process_group_ranks(fsdp.get_group()) if fsdp.ndim == 1 else sorted(
            int(r) for r in fsdp.mesh.flatten())
        assert got == expected(want["fsdp"])[0]
    got_model = roles.model.mesh_dim_names if roles.model is not None else ()
    assert got_model == want.get("model", ()), (got_model, want)
    # the batch role's slice: this rank's rows, in the order of its index (every batch rank a distinct slice)
    batch = torch.arange(8 * roles.batch.size).view(roles.batch.size * 8 // roles.batch.size, -1)
    mine = roles.shard_batch(batch)
    assert torch.equal(mine, batch.chunk(roles.batch.size)[roles.batch.rank])
    assert roles.batch.size > 1
    with pytest.raises(MeshError, match="does not divide"):
        roles.shard_batch(torch.zeros(roles.batch.size + 1, 2))
