"""Matrix optimizers (``torch.optim.Muon``) under ZeRO 1/2/3 and TP: state and update owned by whole matrices.

An elementwise optimizer runs on any flat piece of a parameter (:class:`~vescale.parallel.DistributedOptimizer`); Muon
orthogonalises each 2-D momentum as a whole (Newton-Schulz), so a flat ZeRO piece or a TP shard is not enough. Here
every 2-D parameter of the matrix optimizer has one *owner*: a (dp rank, tp rank) pair chosen by
:func:`matrix_owners` (greedy over the ranks by the Newton-Schulz cost ``m * n * min(m, n)``), which alone holds its
momentum (the whole matrix) and runs torch's own ``Muon`` on the whole matrix, so the numerics are torch's.

One step, per matrix (all matrices of one phase batched into one ``all_to_all_single``):

1. dp gather (ZeRO 2 and 3: each dp rank holds a flat range of the TP-local gradient, and with ZeRO 3 of the
   parameter): the ranges go to the owner's dp rank only, over the dp group (ZeRO 0, and 1 without clipping, skip
   it: every dp rank holds the whole reduced TP-local gradient);
2. tp gather (a TP-sharded DTensor: ``Shard(d)`` over a 1-D tp mesh): the owner's dp rank in every tp column sends
   its TP-local gradient and parameter to the owner, which concatenates them along ``d`` (a matrix replicated over
   tp is owned by every tp rank of the owner's dp row, each computing the same update);
3. the owner steps its whole matrices with its ``torch.optim.Muon`` (the user's param groups and hyper-parameters);
4. tp scatter: the new TP-local matrices back to the owner's dp row;
5. dp scatter: each dp rank's range back to it, written into its piece (ZeRO 1/2: the master piece, which
   DistributedOptimizer's bucket all-gather then spreads; ZeRO 3: the FSDP2 shard).

Bytes moved per matrix of ``N`` elements (fp32): at most ``N`` gradient in, ``N`` parameter in (tp > 1 or ZeRO 3),
``N`` out, against the naive way's all-gather of every matrix's gradient to every rank (``(ranks - 1) x N``).
Memory per rank: the momentum of the matrices it owns (about ``1 / (dp x tp)`` of all, balanced by cost), plus,
with tp > 1 or ZeRO 3, a whole-matrix copy of each owned matrix that torch's Muon steps.

The optimizers built on this step are :mod:`vescale.parallel.matrix_optimizer`'s. In their checkpoints
(``sharded_state_dict``) ``state.<fqn>.momentum_buffer`` is one box, the whole global matrix, on its owner: the
``RaggedShard`` of the matrices' concatenation by owner (:meth:`_MatrixStep.layout`) written as boxes of each global
tensor, so a checkpoint loads on another dp or tp size, whose owners differ.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from vescale.core.sharded_state import Box, ShardedTensor, init_optimizer_state
from vescale.core.torch_internals import local_tensor
from vescale.dtensor import RaggedShard
from vescale.parallel.errors import ZeroError

__all__ = ["matrix_owners", "hidden_matrices"]


#: Module names of output heads and embeddings, for a pipeline stage that holds the head without the embedding table
_NOT_HIDDEN = {"lm_head", "head", "output", "embed_out", "wte", "wpe", "embed", "embed_tokens", "tok_embeddings"}


def hidden_matrices(module: nn.Module) -> list[str]:
    """FQNs of ``module``'s hidden 2-D weights, Muon's usual share: every 2-D parameter but embeddings (of an
    ``nn.Embedding``, or of a module named like one) and the output head (a 2-D weight with as many rows as an
    embedding table, tied to one, or of a module named ``lm_head``/``head``/``output``)."""
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    vocab = {m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)}
    out = []
    for name, p in module.named_parameters():
        owner = name.rsplit(".", 2)[-2] if "." in name else ""
        if p.ndim == 2 and id(p) not in embeddings and p.shape[0] not in vocab and owner not in _NOT_HIDDEN:
            out.append(name)
    return out


def matrix_owners(shapes: list[tuple[int, int]], slots: int, *, replicated: list[bool] | None = None,
                  columns: int = 1) -> list[tuple[int, int | None]]:
    """Owner ``(row, column)`` of each matrix over ``slots = rows x columns`` ranks, balanced by Newton-Schulz cost.

    Greedy, largest first (ties in input order), each to the least-loaded slot (ties: the lowest); a matrix marked
    ``replicated`` is owned by a whole row (column None, its cost added to each of the row's slots). Local and
    deterministic: every rank computes the same owners.
    """
    rows = slots // columns
    replicated = replicated or [False] * len(shapes)
    load = [0.0] * slots
    owners: list[tuple[int, int | None]] = [(0, 0)] * len(shapes)
    order = sorted(range(len(shapes)), key=lambda i: -_cost(shapes[i]))
    for i in order:
        cost = _cost(shapes[i])
        if replicated[i]:
            row = min(range(rows), key=lambda r: (max(load[r * columns:(r + 1) * columns]), r))
            for c in range(columns):
                load[row * columns + c] += cost
            owners[i] = (row, None)
        else:
            s = min(range(slots), key=lambda k: (load[k], k))
            load[s] += cost
            owners[i] = (s // columns, s % columns)
    return owners


def _cost(shape: tuple[int, int]) -> float:
    m, n = shape
    return float(m) * n * min(m, n)


@dataclass(eq=False)
class _Matrix:
    """One 2-D parameter of the matrix optimizer and where its pieces live on this rank.

    ``ranges[r]``: the flat range of the TP-local matrix dp rank ``r`` holds (the gradient; with ``param_local``
    False also the parameter); ``grad_piece``/``param_piece``: this rank's range of the reduced gradient / of the
    parameter (a writable view); ``grad_local``/``param_local``: the whole TP-local gradient / parameter where every dp
    rank holds it, else None.
    """

    fqn: str
    param: nn.Parameter
    group: int
    shape: tuple[int, int]
    tp_dim: int | None
    tp_sizes: list[int]
    ranges: list[tuple[int, int]]
    grad_piece: Callable[[], torch.Tensor]
    param_piece: Callable[[], torch.Tensor]
    grad_local: Callable[[], torch.Tensor] | None
    param_local: Callable[[], torch.Tensor] | None
    owner: tuple[int, int | None] = (0, 0)
    work: torch.Tensor | None = None  # on an owner: the whole matrix its torch Muon steps

    def local_shape(self, tp_rank: int) -> tuple[int, int]:
        if self.tp_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.tp_dim] = self.tp_sizes[tp_rank]
        return tuple(shape)


def _tp_layout(fqn: str, p: torch.Tensor, tp_mesh_dim: int | None) -> tuple[int | None, list[int], Any]:
    """(sharded dim, TP-local extent per tp rank, tp group) of ``p`` on its mesh dim ``tp_mesh_dim``."""
    if not isinstance(p, DTensor) or tp_mesh_dim is None:
        return None, [], None
    mesh = p.device_mesh
    pl = p.placements[tp_mesh_dim]
    group, size = mesh.get_group(tp_mesh_dim), mesh.size(tp_mesh_dim)
    if isinstance(pl, Replicate) or size == 1:
        return None, [], group
    if type(pl) is not Shard:
        raise ZeroError(f"matrix optimizer: parameter {fqn!r} has placement {pl} on mesh dim "
                        f"{mesh.mesh_dim_names[tp_mesh_dim] if mesh.mesh_dim_names else tp_mesh_dim}; only Shard(d) "
                        "and Replicate over tp are supported")
    dim = pl.dim % 2
    n = p.shape[dim]
    step = -(-n // size)
    return dim, [max(0, min(n, (t + 1) * step) - min(n, t * step)) for t in range(size)], group


def _exchange(group, size: int, sends: list[list[torch.Tensor]], recv_sizes: list[int],
              like: torch.Tensor) -> list[torch.Tensor]:
    """One ``all_to_all_single`` over ``group``: ``sends[r]`` (1-D tensors) concatenated to rank ``r``; returns what
    each rank sent here (1-D, ``recv_sizes[r]`` elements). With ``size == 1``, what this rank sent itself."""
    flat = [torch.cat([t.reshape(-1) for t in s]) if s else like.new_empty(0) for s in sends]
    if size == 1:
        return flat
    send = torch.cat(flat)
    recv = like.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, recv_sizes, [t.numel() for t in flat], group=group)
    return list(recv.split(recv_sizes))


class _MatrixStep:
    """The owner-based step of a ``torch.optim.Muon``'s matrices over (dp group, tp group); see the module doc."""

    def __init__(self, matrices: list[_Matrix], matrix: torch.optim.Optimizer, *, dp_group,
                 dp_size: int, dp_rank: int, tp_group, tp_size: int, tp_rank: int) -> None:
        self.matrices = matrices
        self.dp_group, self.dp, self.dp_rank = dp_group, dp_size, dp_rank
        self.tp_group, self.tp, self.tp_rank = tp_group, tp_size, tp_rank
        #: bytes this rank received from other ranks in the last step's exchanges
        self.received = 0
        owners = matrix_owners([m.shape for m in matrices], dp_size * tp_size, columns=tp_size,
                               replicated=[m.tp_dim is None for m in matrices])
        inner_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in matrix.param_groups]
        for m, owner in zip(matrices, owners):
            m.owner = owner
            if self.owns(m):
                local_param = m.param_local is not None and m.tp_dim is None
                m.work = m.param_local().view(m.shape) if local_param else torch.zeros(m.shape, dtype=torch.float32,
                                                                         device=m.grad_piece().device)
                inner_groups[m.group]["params"].append(m.work)
        # Hyper-parameters travel in the groups; pass only the defaults the constructor accepts.
        accepted = inspect.signature(type(matrix).__init__).parameters
        defaults = {k: v for k, v in matrix.defaults.items() if k in accepted}
        #: the torch optimizer stepping this rank's whole matrices (its groups are the user's, possibly empty)
        self.optimizer = type(matrix)(inner_groups, **defaults)

    def _exchange(self, group, size: int, rank: int, sends, sizes: list[int], like: torch.Tensor):
        self.received += (sum(sizes) - sizes[rank]) * like.element_size()
        return _exchange(group, size, sends, sizes, like)

    def owns(self, m: _Matrix) -> bool:
        return m.owner[0] == self.dp_rank and m.owner[1] in (None, self.tp_rank)

    def layout(self) -> RaggedShard:
        """The momentum of every matrix, flattened and concatenated by owner rank (dp-major): a ragged shard of
        whole matrices over the dp x tp ranks (a replicated matrix counts on its row's tp rank 0)."""
        per_rank = [0] * (self.dp * self.tp)
        for m in self.matrices:
            per_rank[m.owner[0] * self.tp + (m.owner[1] or 0)] += math.prod(m.shape)
        return RaggedShard((0,), per_rank)

    @torch.no_grad()
    def step(self) -> None:
        self.received = 0
        ms, like = self.matrices, self.matrices[0].grad_piece() if self.matrices else None
        if like is None:
            return
        # 1. dp gather: ranges to the owner's dp rank (what every dp rank does not hold already)
        grad_local: dict[int, torch.Tensor] = {}
        param_local: dict[int, torch.Tensor] = {}
        mine = [m for m in ms if m.owner[0] == self.dp_rank]
        tp_local = self.tp_rank
        if self.dp > 1 and any(m.grad_local is None or m.param_local is None for m in ms):
            sends: list[list[torch.Tensor]] = [[] for _ in range(self.dp)]
            for m in ms:
                if m.grad_local is None:
                    sends[m.owner[0]].append(m.grad_piece())
                if m.param_local is None:
                    sends[m.owner[0]].append(m.param_piece())
            sizes = [sum(((m.grad_local is None) + (m.param_local is None)) * (m.ranges[r][1] - m.ranges[r][0])
                         for m in mine) for r in range(self.dp)]
            recv = self._exchange(self.dp_group, self.dp, self.dp_rank, sends, sizes, like)
            at = [0] * self.dp
            for m in mine:
                for need, out in ((m.grad_local is None, grad_local), (m.param_local is None, param_local)):
                    if not need:
                        continue
                    parts = []
                    for r in range(self.dp):
                        n = m.ranges[r][1] - m.ranges[r][0]
                        parts.append(recv[r][at[r]:at[r] + n])
                        at[r] += n
                    out[id(m)] = torch.cat(parts).view(m.local_shape(tp_local))
        for m in mine:
            if m.grad_local is not None:
                grad_local[id(m)] = m.grad_local().view(m.local_shape(tp_local))
            if m.param_local is not None:
                param_local[id(m)] = m.param_local().view(m.local_shape(tp_local))
            elif self.dp == 1:
                param_local[id(m)] = m.param_piece().view(m.local_shape(tp_local))
                grad_local.setdefault(id(m), m.grad_piece().view(m.local_shape(tp_local)))
        # 2. tp gather: TP-local gradient and parameter of each sharded matrix to its owner in this dp row
        sharded = [m for m in mine if m.tp_dim is not None]
        full_grad: dict[int, torch.Tensor] = {}
        full_param: dict[int, torch.Tensor] = {}
        if self.tp > 1 and sharded:
            sends = [[] for _ in range(self.tp)]
            for m in sharded:
                sends[m.owner[1]] += [grad_local[id(m)], param_local[id(m)]]
            owned = [m for m in sharded if m.owner[1] == self.tp_rank]
            sizes = [sum(2 * math.prod(m.local_shape(t)) for m in owned) for t in range(self.tp)]
            recv = self._exchange(self.tp_group, self.tp, self.tp_rank, sends, sizes, like)
            at = [0] * self.tp
            for m in owned:
                grads, params = [], []
                for t in range(self.tp):
                    n = math.prod(m.local_shape(t))
                    grads.append(recv[t][at[t]:at[t] + n].view(m.local_shape(t)))
                    params.append(recv[t][at[t] + n:at[t] + 2 * n].view(m.local_shape(t)))
                    at[t] += 2 * n
                full_grad[id(m)] = torch.cat(grads, dim=m.tp_dim)
                full_param[id(m)] = torch.cat(params, dim=m.tp_dim)
        # 3. torch's Muon on the whole matrices this rank owns
        owned = [m for m in ms if self.owns(m)]
        for m in owned:
            g = full_grad.get(id(m), grad_local.get(id(m)))
            p = full_param.get(id(m), param_local.get(id(m)))
            if p.data_ptr() != m.work.data_ptr():
                m.work.copy_(p)
            m.work.grad = g.to(m.work.dtype)
        self.optimizer.step()
        for m in owned:
            m.work.grad = None
        # 4. tp scatter: the new TP-local matrices back to this dp row
        new_local: dict[int, torch.Tensor] = {}
        for m in mine:
            if m.tp_dim is None:
                new_local[id(m)] = m.work
        if self.tp > 1 and sharded:
            sends = [[] for _ in range(self.tp)]
            for m in sharded:
                if m.owner[1] == self.tp_rank:
                    for t, part in enumerate(m.work.split(m.tp_sizes, dim=m.tp_dim)):
                        sends[t].append(part)
            sizes = [sum(math.prod(m.local_shape(tp_local)) for m in sharded if m.owner[1] == t)
                     for t in range(self.tp)]
            recv = self._exchange(self.tp_group, self.tp, self.tp_rank, sends, sizes, like)
            at = [0] * self.tp
            for m in sharded:
                t, n = m.owner[1], math.prod(m.local_shape(tp_local))
                new_local[id(m)] = recv[t][at[t]:at[t] + n].view(m.local_shape(tp_local))
                at[t] += n
        # 5. dp scatter: each dp rank's range back into its piece
        if self.dp > 1:
            sends = [[] for _ in range(self.dp)]
            for m in mine:
                flat = new_local[id(m)].reshape(-1)
                for r in range(self.dp):
                    sends[r].append(flat[m.ranges[r][0]:m.ranges[r][1]])
            sizes = [sum(m.ranges[self.dp_rank][1] - m.ranges[self.dp_rank][0] for m in ms if m.owner[0] == r)
                     for r in range(self.dp)]
            recv = self._exchange(self.dp_group, self.dp, self.dp_rank, sends, sizes, like)
            at = [0] * self.dp
            for m in ms:
                r = m.owner[0]
                n = m.ranges[self.dp_rank][1] - m.ranges[self.dp_rank][0]
                piece = m.param_piece()
                piece.copy_(recv[r][at[r]:at[r] + n])
                at[r] += n
        else:
            for m in mine:
                target = m.param_local() if m.param_local is not None else m.param_piece()
                if target.data_ptr() != new_local[id(m)].data_ptr():
                    target.view(-1).copy_(new_local[id(m)].reshape(-1))

    # -- state ----------------------------------------------------------------------------------------------------

    def sharded_state_dict(self, out: dict[str, Any]) -> None:
        for m in self.matrices:
            out[f"param_groups.{m.fqn}"] = _hparams(self.optimizer.param_groups[m.group])
            if not self.owns(m):
                continue
            for name, value in self.optimizer.state.get(m.work, {}).items():
                key = f"state.{m.fqn}.{name}"
                if isinstance(value, torch.Tensor) and tuple(value.shape) == m.shape:
                    out[key] = ShardedTensor(m.shape, value.dtype, [Box((0, 0), m.shape, value)],
                                             updated_by_step=True, name=key)
                else:
                    out[key] = value

    def load_sharded_state_dict(self, sd: dict[str, Any]) -> None:
        for m in self.matrices:
            group = self.optimizer.param_groups[m.group]
            for k, v in sd.get(f"param_groups.{m.fqn}", {}).items():
                group[k] = tuple(v) if k == "ns_coefficients" else v

    def state_dict(self) -> dict[str, Any]:
        """This rank's owned state by FQN (whole matrices), the owners and the groups' hyper-parameters."""
        state = {m.fqn: dict(self.optimizer.state.get(m.work, {})) for m in self.matrices if self.owns(m)}
        return {"owners": {m.fqn: list(m.owner) for m in self.matrices}, "state": state,
                "param_groups": [_hparams(g) for g in self.optimizer.param_groups]}

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load :meth:`state_dict` of the same layout (same owners); another layout raises naming the first FQN
        whose owner moved (reshard through ``sharded_state_dict`` and vescale-checkpoint instead)."""
        for m in self.matrices:
            saved = sd["owners"].get(m.fqn)
            if saved is None or tuple(saved) != tuple(m.owner):
                raise ZeroError(f"matrix optimizer state: {m.fqn!r} was owned by {saved}, here by {list(m.owner)}; "
                                "load another layout through vescale.checkpoint")
        for group, saved in zip(self.optimizer.param_groups, sd["param_groups"]):
            group.update({k: tuple(v) if k == "ns_coefficients" else v for k, v in saved.items()})
        self.init_state()
        for m in self.matrices:
            if self.owns(m):
                for name, value in sd["state"].get(m.fqn, {}).items():
                    mine = self.optimizer.state[m.work]
                    if isinstance(value, torch.Tensor):
                        mine[name].copy_(value)
                    else:
                        mine[name] = value

    def init_state(self) -> None:
        owned = [m for m in self.matrices if self.owns(m)]
        if owned and not self.optimizer.state:
            init_optimizer_state(self.optimizer)

    def state_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for st in self.optimizer.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor))


def _hparams(group: dict) -> dict[str, Any]:
    return {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v)
            for k, v in group.items() if k != "params"}


def _check_matrix(fqn: str, p: torch.Tensor, *, fp32_master: bool = False) -> None:
    if p.ndim != 2:
        raise ZeroError(f"matrix optimizer: parameter {fqn!r} has shape {tuple(p.shape)}; only 2-D parameters "
                        "can be in its groups (put the rest in the elementwise optimizer)")
    if p.dtype != torch.float32 and not fp32_master:
        raise ZeroError(f"matrix optimizer: parameter {fqn!r} is {p.dtype}; the distributed Muon steps fp32 "
                        "weights: low-precision parameters need fp32 masters (DistributedMatrixOptimizer over a "
                        "DistributedDataParallel, ZeRO 0-2) or FSDP2's fp32 shards (ZeRO 3 with a bf16 policy)")


def _grad_of(p: torch.Tensor) -> Callable[[], torch.Tensor]:
    def grad() -> torch.Tensor:
        if p.grad is None:
            return torch.zeros(local_tensor(p).numel(), dtype=p.dtype, device=local_tensor(p).device)
        return local_tensor(p.grad).reshape(-1)
    return grad


def _data_of(p: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: local_tensor(p).detach().view(-1)
