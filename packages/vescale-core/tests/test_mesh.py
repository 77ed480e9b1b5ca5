"""vescale.core.mesh: canonical order, clear errors, sub-meshes."""

from __future__ import annotations

import pytest

from vescale.core.errors import MeshError
from vescale.core.mesh import parse_mesh_spec
from vescale.core.testing import multi_rank


def test_parse_mesh_spec():
    assert parse_mesh_spec("pp=2, dp=2,tp=2") == {"pp": 2, "dp": 2, "tp": 2}
    for bad in ["", "dp", "dp=x", "dp=2,dp=2", "=2"]:
        with pytest.raises(MeshError):
            parse_mesh_spec(bad)


@multi_rank(world_sizes=[4])
def test_init_mesh_orders_dims_canonically():
    import torch.distributed as dist

    from vescale.core.mesh import dim_size, init_mesh, mesh_coordinates, sub_mesh

    mesh = init_mesh({"tp": 2, "dp": 2})
    assert mesh.mesh_dim_names == ("dp", "tp")
    rank = dist.get_rank()
    # tp is innermost: ranks 0,1 share a dp index and differ in tp.
    assert mesh_coordinates(mesh) == {"dp": rank // 2, "tp": rank % 2}
    assert dim_size(mesh, "tp") == 2 and dim_size(mesh, "pp") == 1
    tp = sub_mesh(mesh, "tp")
    assert tp.mesh.tolist() == [2 * (rank // 2), 2 * (rank // 2) + 1]
    assert sub_mesh(mesh, "tp", "dp").mesh_dim_names == ("dp", "tp")
    with pytest.raises(MeshError, match="cannot take sub-mesh"):
        sub_mesh(mesh, "pp")

    kept = init_mesh("pp=1,dp=4")  # size-1 dims are kept
    assert kept.mesh_dim_names == ("pp", "dp") and dim_size(kept, "pp") == 1


@multi_rank(world_sizes=[1, 2])
def test_init_mesh_errors_are_clear(world_size):
    from vescale.core.mesh import init_mesh

    with pytest.raises(MeshError, match=rf"has 8 ranks but the world size is {world_size}"):
        init_mesh({"pp": 2, "dp": 2, "tp": 2})
    with pytest.raises(MeshError, match="unknown mesh dimension"):
        init_mesh({"xp": world_size})
    with pytest.raises(MeshError, match="positive integer"):
        init_mesh({"dp": 0})
    mesh = init_mesh({"foo": world_size}, order=("foo",))
    assert mesh.mesh_dim_names == ("foo",)


@multi_rank(world_sizes=[4])
def test_dim_mesh_and_dim_group_resolve_a_dimension_by_name():
    import torch.distributed as dist

    from vescale.core.mesh import dim_group, dim_mesh, init_mesh

    rank = dist.get_rank()
    mesh = init_mesh({"dp": 2, "tp": 2})
    assert dim_mesh(mesh, "dp").mesh.tolist() == [rank % 2, rank % 2 + 2]
    assert dim_mesh(mesh, ("tp", "dp")).mesh_dim_names == ("dp", "tp")
    assert dim_mesh(mesh, "pp") is None and dim_mesh(mesh, ("dp", "pp")) is None
    group, name = dim_group(mesh, "tp")
    assert name == "tp" and dist.get_process_group_ranks(group) == [2 * (rank // 2), 2 * (rank // 2) + 1]
    assert dim_group(mesh, "ep") is None
    # a 1-D mesh is the dimension asked for (the data-parallel APIs' convention) unless whole_if_1d=False
    flat = init_mesh({"tp": 4})
    assert dim_mesh(flat, "dp") is flat and dim_mesh(flat, "dp", whole_if_1d=False) is None
    group, name = dim_group(flat, "dp")
    assert name == "tp" and dist.get_process_group_ranks(group) == [0, 1, 2, 3]
    # a process group is taken as is, under the name asked for
    assert dim_group(dist.group.WORLD, "dp") == (dist.group.WORLD, "dp")
