"""``generate()`` of unmodified Hugging Face models (Llama, Qwen2, Mixtral, GPT-2) after ``parallelize_module`` with
their hand plans, token for token against the same call on one process, at tp=2 and dp=2 x tp=2.

Left-padded prompts with an attention mask; greedy through the default (dynamic) cache and a ``StaticCache``, with an
EOS token that stops one row early; seeded sampling (temperature, top-k, top-p). Every rank seeds torch's generator
alike and the ranks of a tp group hold the same full logits, so they draw the same tokens (asserted). With dp each
group passes its own rows: greedy equals those rows of the one-device batch; a sampled batch is one random stream, so
a group's draws equal one device's ``generate`` of that group's rows under the same seed. After every call each
rank's KV cache (dynamic or static) holds its group's rows and 1/tp of one device's heads (local shapes; GPT-2's fused
``c_attn`` output splits into head-sharded q, k, v without a gather).

The model builders (``_build``, small GQA configs) and the padded batch (``_batch``) are those of ``test_tp_hf`` and
``test_hf_default_calls``.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

MODELS = ["llama", "qwen2", "mixtral", "gpt2"]
MESHES = {2: {"tp": 2}, 4: {"dp": 2, "tp": 2}}
PAD = 0


def _sibling(name: str):
    """A test module of this folder (the suite runs with ``--import-mode=importlib``: the folder is not on
    ``sys.path``, here or in the rank processes)."""
    import importlib.util
    import sys
    from pathlib import Path

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _prompts(rows: int):
    ids, mask, _ = _sibling("test_hf_default_calls")._batch(rows)
    return ids[:, :5].masked_fill(mask[:, :5] == 0, PAD), mask[:, :5]


def _rows_equal(got, want, eos: int) -> None:
    """``got`` (a dp group's output, stopped when its rows were done) is ``want`` (those rows of the one-device
    output) cut to its length; what one device generated past it is padding after an EOS."""
    import torch

    n = got.shape[1]
    assert torch.equal(got, want[:, :n]), (got, want)
    if want.shape[1] > n:
        assert bool((want[:, n:] == PAD).all()) and bool((got == eos).any(dim=1).all()), (got, want)


def _cache_tensors(cache) -> list:
    """This rank's tensors of a KV cache (a DTensor's local shard), keys and values of every layer."""
    from torch.distributed.tensor import DTensor

    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


@pytest.mark.parametrize("kind", MODELS)
@multi_rank(world_sizes=[2, 4])
def test_generate_matches_single_device(world_size, kind):
    import copy

    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh, sub_mesh
    from vescale.parallel import PLANS, parallelize_module

    mesh_dims = MESHES[world_size]
    mesh = init_mesh(mesh_dims)
    dp, tp = mesh_dims.get("dp", 1), mesh_dims["tp"]
    torch.manual_seed(0)
    ref = _sibling("test_tp_hf")._build(kind, 0.0, "sdpa").eval()
    par = parallelize_module(copy.deepcopy(ref), mesh, PLANS[kind](mesh))
    rank = mesh.get_local_rank("dp") if dp > 1 else 0
    prompts, mask = _prompts(2 * dp)
    mine = slice(2 * rank, 2 * rank + 2)
    n_new = 6
    # an EOS that row 0 produces at its third step: that row stops early (then pads), the others go on
    free = ref.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=n_new, pad_token_id=PAD,
                        do_sample=False)
    eos = int(free[0, prompts.shape[1] + 2])
    greedy = dict(do_sample=False, eos_token_id=eos)
    settings = [greedy, dict(greedy, cache_implementation="static"),
                dict(do_sample=True, top_k=8, top_p=0.9, temperature=0.8)]
    tp_group = sub_mesh(mesh, "tp").get_group()
    with torch.no_grad():
        for kw in settings:
            torch.manual_seed(11)
            out = par.generate(input_ids=prompts[mine], attention_mask=mask[mine], max_new_tokens=n_new,
                               pad_token_id=PAD, return_dict_in_generate=True, **kw)
            got = out.sequences
            torch.manual_seed(11)
            # sampling: one device's draws for this group's rows; greedy: the whole batch
            rows = mine if kw["do_sample"] else slice(None)
            one = ref.generate(input_ids=prompts[rows], attention_mask=mask[rows], max_new_tokens=n_new,
                               pad_token_id=PAD, return_dict_in_generate=True, **kw)
            want = one.sequences
            _rows_equal(got, want if kw["do_sample"] else want[mine], eos)
            # the KV cache sharded by heads: each rank holds its 2 rows and 1/tp of one device's heads
            for mine_kv, one_kv in zip(_cache_tensors(out.past_key_values), _cache_tensors(one.past_key_values),
                                       strict=True):
                assert (mine_kv.shape[0], mine_kv.shape[1] * tp, mine_kv.shape[3]) == \
                    (2, one_kv.shape[1], one_kv.shape[3]), (kind, kw, mine_kv.shape, one_kv.shape)
            seen = [None] * tp
            dist.all_gather_object(seen, got.tolist(), group=tp_group)
            assert all(s == seen[0] for s in seen), (kind, kw, seen)
