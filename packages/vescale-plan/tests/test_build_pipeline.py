"""build_pipeline on a deferred model (the path ``auto_parallelize``'s eager tests do not take): each pp rank
materialises only its stage, bitwise the single-device init, and one engine step computes the single-device loss
and gradients (fp32, different reduction grouping per microbatch: rtol 1e-5)."""

from __future__ import annotations

from vescale.core.testing import multi_rank


@multi_rank(world_sizes=[2])
def test_build_pipeline_of_a_deferred_model_is_the_single_device_model(world_size):
    import torch

    from vescale.core.mesh import init_mesh
    from vescale.core.testing.models import GPT, GPTConfig
    from vescale.dtensor import deferred_init, is_deferred, materialize
    from vescale.dtensor import random as R
    from vescale.plan import build_pipeline, language_model_loss

    cfg = GPTConfig(vocab_size=32, d_model=32, n_layer=2, n_head=4)
    R.manual_seed(7)
    ref = materialize(deferred_init(GPT, cfg))
    R.manual_seed(7)
    model = deferred_init(GPT, cfg)
    mesh = init_mesh({"pp": 2})
    ids = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(0))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    engine = build_pipeline(model, mesh, example_inputs=(inputs[:2],), num_microbatches=2,
                            loss_fn=language_model_loss, device="cpu")
    rank = mesh.get_local_rank()
    assert engine.num_stages == 2 and list(engine.stages) == [rank]
    (stage,) = engine.stages.values()
    names = [n for n, _ in stage.named_parameters()]
    want = dict(ref.named_parameters())
    # stage 0 starts with the embedding, the last stage ends with the head; each holds only its own tensors
    assert ("embed.weight" in names) == (rank == 0) and ("lm_head.weight" in names) == (rank == 1)
    for name, p in stage.named_parameters():
        assert not p.is_meta and torch.equal(p, want[name]), name
    assert is_deferred(model)  # the parts of other ranks were never materialised here

    loss = engine.step(inputs, targets)
    ref_loss = language_model_loss(ref(inputs), targets)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    R.uninstall()  # the pooled ranks serve other packages' tests too
