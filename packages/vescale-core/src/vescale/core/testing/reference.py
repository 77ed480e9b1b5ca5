"""Single-device references for tests that compare a parallel run against one process.

Every parallel test needs the same thing to compare against: the unmodified model trained (or differentiated) on one
process over the whole batch. These helpers are that loop, written once:

* :func:`reference_training` trains a fresh model for some steps and returns its losses, clipped gradient norms and
  final weights (a :class:`ReferenceRun`).
* :func:`reference_gradients` accumulates one batch's gradient over microbatches, as a pipeline does, and returns
  the per-microbatch losses and the gradients by FQN.
* :func:`data_parallel_training` is the other side of the comparison for data parallelism: the same steps on this
  rank's rows of each global batch, returning the dp-mean loss per step.
* :func:`one_thread` / :func:`single_threaded` pin torch to one intra-op thread (tiny models on a loaded machine).
* :func:`progression_batch` is a small learnable batch (arithmetic progressions), the same on every process.
* :func:`saved_activation_bytes` measures what autograd keeps for backward (activation memory, parameters apart).

Only torch is needed; the default loss is :func:`vescale.core.testing.models.cross_entropy`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["assert_first_adamw_step", "ReferenceRun", "reference_training", "reference_gradients",
           "data_parallel_training", "one_thread", "single_threaded", "progression_batch", "saved_activation_bytes"]

#: ``step -> (inputs, targets)``: the global batch of a step, the same on every rank and in the reference.
Batches = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


class ReferenceRun(NamedTuple):
    """What :func:`reference_training` returns (unpacks as ``losses, grad_norms, state``)."""

    losses: list[float]  # the loss of each step, before its update
    grad_norms: list[float]  # the total gradient norm of each step before clipping (empty without ``clip``)
    state: dict[str, torch.Tensor]  # the final ``state_dict``, detached copies


def _default_loss() -> LossFn:
    from vescale.core.testing.models import cross_entropy

    return cross_entropy


def reference_training(model_fn: Callable[[], nn.Module], batches: Batches,
                       optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], steps: int,
                       clip: float | None = None, loss_fn: LossFn | None = None) -> ReferenceRun:
    """Train ``model_fn()`` on one process for ``steps`` steps; return its losses, grad norms and final state.

    Step ``s``: ``loss_fn(model(x), y)`` on ``batches(s)``, ``backward``, ``clip_grad_norm_(clip)`` when ``clip`` is
    given (its returned pre-clip norm is recorded), ``optimizer.step()``, ``zero_grad()``. ``optimizer_fn`` receives
    the model's parameters. Raises ``ValueError`` for ``steps < 0`` or ``clip <= 0``.
    """
    if steps < 0:
        raise ValueError(f"reference_training: steps must be >= 0, got {steps}")
    if clip is not None and clip <= 0:
        raise ValueError(f"reference_training: clip must be > 0 (or None for no clipping), got {clip}")
    loss_fn = loss_fn or _default_loss()
    model = model_fn()
    opt = optimizer_fn(model.parameters())
    losses, norms = [], []
    for step in range(steps):
        x, y = batches(step)
        loss = loss_fn(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return ReferenceRun(losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()})


def reference_gradients(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, num_microbatches: int,
                        loss_fn: LossFn | None = None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The gradient of the mean microbatch loss of one batch, accumulated over microbatches on one process.

    Splits ``inputs``/``targets`` into ``num_microbatches`` chunks along dim 0 and runs ``(loss_fn(model(x_m), y_m)
    / M).backward()`` for each in order. Returns the detached loss of every microbatch and every parameter's
    gradient by FQN (tied parameters under each of their names; parameters that got none are left out). ``model``'s
    gradients are cleared before and after, since pipeline stages built from it share its parameters. Raises
    ``ValueError`` when the batch does not split into ``num_microbatches`` equal chunks.
    """
    if num_microbatches < 1 or inputs.shape[0] % num_microbatches:
        raise ValueError(f"reference_gradients: a batch of {inputs.shape[0]} rows does not split into "
                         f"{num_microbatches} equal microbatches")
    loss_fn = loss_fn or _default_loss()
    model.zero_grad(set_to_none=True)
    losses = []
    for xm, ym in zip(inputs.chunk(num_microbatches), targets.chunk(num_microbatches)):
        loss = loss_fn(model(xm), ym)
        (loss / num_microbatches).backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return losses, grads


def data_parallel_training(model: nn.Module, optimizer: Any, batches: Batches, steps: int, *, dp_rank: int, dp: int,
                           dp_group: Any = None, accum: int = 1, first_step: int = 0,
                           sync: Callable[[bool], contextlib.AbstractContextManager] | None = None,
                           before_step: Callable[[], None] | None = None, after_step: Callable[[], None] | None = None,
                           autocast: torch.dtype | None = None, loss_fn: LossFn | None = None) -> list[float]:
    """Train on this data-parallel rank's rows of each global batch; return the dp-mean loss of every step.

    Steps ``first_step .. first_step + steps - 1``: rank ``dp_rank`` takes rows ``[dp_rank * B/dp, (dp_rank + 1) *
    B/dp)`` of ``batches(step)`` and runs ``accum`` microbatches of them, each ``(loss / accum).backward()``; then
    ``before_step()`` (e.g. clipping), ``optimizer.step()``, ``after_step()`` (e.g. reading a grad norm),
    ``optimizer.zero_grad()``. ``sync(last)`` returns the context a microbatch's backward runs in (``last``: whether
    gradients should be reduced now); by default ``model.no_sync()`` for all but the last microbatch when the model
    has it. ``autocast`` runs the forward under CPU autocast to that dtype (the loss in fp32). The step's loss is
    summed over ``dp_group`` (an all-reduce, the default group when None) and divided by ``dp``. Raises
    ``ValueError`` when the batch rows do not split into ``dp`` ranks x ``accum`` microbatches.
    """
    loss_fn = loss_fn or _default_loss()
    if sync is None:
        no_sync = getattr(model, "no_sync", None)

        def sync(last: bool) -> contextlib.AbstractContextManager:
            return contextlib.nullcontext() if last or no_sync is None else no_sync()

    losses = []
    for step in range(first_step, first_step + steps):
        x, y = batches(step)
        if x.shape[0] % (dp * accum):
            raise ValueError(f"data_parallel_training: a batch of {x.shape[0]} rows does not split into dp={dp} "
                             f"ranks x accum={accum} microbatches")
        rows = x.shape[0] // dp
        x, y = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
        total = torch.zeros(())
        micro = rows // accum
        for i in range(accum):
            xs, ys = x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]
            amp = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
            with sync(i == accum - 1):
                with amp:
                    out = model(xs)
                loss = loss_fn(out.float() if autocast is not None else out, ys) / accum
                loss.backward()
            total += loss.detach()
        if before_step is not None:
            before_step()
        optimizer.step()
        if after_step is not None:
            after_step()
        optimizer.zero_grad()
        torch.distributed.all_reduce(total, group=dp_group)
        losses.append(total.item() / dp)
    return losses


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run with one intra-op torch thread: on a loaded 2-core machine more threads only spin against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def single_threaded(body: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a (rank's test) function to run under :func:`one_thread`."""

    @functools.wraps(body)
    def run(*args: Any, **kwargs: Any) -> Any:
        with one_thread():
            return body(*args, **kwargs)

    return run


def progression_batch(seed: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable batch: ``batch`` arithmetic progressions mod ``vocab`` (random start, stride 1-3) from ``seed``.

    Returns ``(inputs, targets)``, int64 ``[batch, seq]`` each, targets shifted by one. The same on every process.
    """
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def assert_first_adamw_step(name: str, w: torch.Tensor, w_ref: torch.Tensor, g: torch.Tensor, g_ref: torch.Tensor,
                             lr: float, eps: float = 1e-8) -> None:
    """``w``, one AdamW step (default betas, ``eps``) from the single-device initial weights with gradient ``g``,
    against ``w_ref``, the same step with ``g_ref``, at a bound derived from the step rather than fp32 epsilon.

    The first step moves a weight by ``-lr * u(g)``, ``u(g) = g / (|g| + eps)`` (the bias corrections cancel; weight
    decay scales both by the same ``1 - lr * wd``). So the two runs' weights differ by ``lr * |u(g) - u(g_ref)|``
    (<= 2 lr), plus fp32 rounding of the update and the weight (a few ulp: ``1e-6 * (|w_ref| + lr)``). The
    gradients were checked tightly (rtol 1e-5) beforehand; their rounding differences, which depend on the CPU's
    kernels, matter here only where ``|g|`` is near ``eps``: Adam divides a near-zero gradient by its own magnitude.
    """
    u, u_ref = (t.double() / (t.double().abs() + eps) for t in (g, g_ref))
    bound = lr * (u - u_ref).abs() + 1e-6 * (w_ref.double().abs() + lr)
    excess = (w.double() - w_ref.double()).abs() - bound
    worst = int(excess.flatten().argmax())
    assert excess.max() <= 0, (f"{name}: element {worst} is {w.flatten()[worst].item()!r}, one device "
                               f"{w_ref.flatten()[worst].item()!r}; bound {bound.flatten()[worst].item():.3g} "
                               f"(gradient {g.flatten()[worst].item():.3g} vs {g_ref.flatten()[worst].item():.3g})")


def saved_activation_bytes(model: nn.Module, step: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``step()`` runs the forward (returning the
    loss, which is then back-propagated), the model's parameters left out: the activation memory of one step."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return sum(seen.values())
