"""vescale.core.testing.const_grads: the net's gradients are the constants, the reference's state is rounded."""

from __future__ import annotations

import torch

from vescale.core.testing.const_grads import const_grad_net, const_grad_reference, dyadic_consts, split_matrices

SHAPES = {"a": (6, 4), "b": (3, 6)}


def test_gradients_are_the_constants_and_exact_means():
    net = const_grad_net(SHAPES, norm=4)
    assert torch.equal(net.a.weight, const_grad_net(SHAPES, norm=4).a.weight)  # same weights on every call
    consts = dyadic_consts(net, 1, 0)
    net(consts).backward()
    for name, p in net.named_parameters():
        assert torch.equal(p.grad, consts[name]), name
        assert torch.equal(consts[name] * 8, (consts[name] * 8).round()) and consts[name].abs().max() <= 2, name
    assert not torch.equal(consts["a.weight"], dyadic_consts(net, 1, 1)["a.weight"])  # each rank its own


def test_reference_steps_on_the_dp_mean_and_rounds_state():
    net = const_grad_net(SHAPES)
    start = net.a.weight.detach().clone()
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    const_grad_reference(net, [opt], [2])
    mean = (dyadic_consts(net, 0, 0)["a.weight"] + dyadic_consts(net, 0, 1)["a.weight"]) / 2
    assert torch.equal(net.a.weight.detach(), start - mean)
    mats, rest = split_matrices(net, ["a"])
    assert mats == [net.a.weight] and [id(p) for p in rest] == [id(net.b.weight), id(net.b.bias)]
    adam = torch.optim.AdamW(net.parameters())
    const_grad_reference(net, [adam], [2, 2], state_dtype=torch.bfloat16)
    held = [v for st in adam.state.values() for k, v in st.items() if k != "step"]
    assert held and {v.dtype for v in held} == {torch.bfloat16}
    assert all(st["step"].dtype == torch.float32 for st in adam.state.values())
