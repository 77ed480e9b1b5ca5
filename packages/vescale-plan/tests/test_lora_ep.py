"""A PEFT (LoRA, attention projections) Mixtral through ``vescale.plan.build`` on ep2, dp2 x ep2, ep2 x tp2 and
pp2 x ep2, against one device's PEFT model (plain peft + torch on the global batch); model and check: test_lora.py's.

Each case: the loss, every adapter's gradient after one step and the adapters after two AdamW steps equal one
device's (rtol 1e-5: sums in another order); the frozen base weights (the experts included: ``Shard(0)`` over ep, or
under pp this ep rank's plain rows) get no gradient, no optimizer state and no gradient buckets. Each data rank
(dp x ep) runs its own rows. Adapters on the experts' stacked parameters (peft ``target_parameters``) are refused on
ep by name, and LoRA on cp is refused. Tiny model, pooled ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vescale.core.testing import multi_rank

peft = pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).parent))  # (importlib mode: test_lora's model and check by this folder's path)
from test_lora import BATCH, SEQ, _loss, _peft_mixtral, _run  # noqa: E402


@multi_rank(world_sizes=[2])
def test_lora_mixtral_ep2():
    from vescale.plan import SpecError

    _run("mixtral", {"ep": 2})
    with pytest.raises(SpecError, match=r"experts' stacked parameters \('base_model\.model\.model\.layers\.0\.mlp"
                                        r"\.experts'.*refused on ep=2"):
        _run("mixtral", {"ep": 2}, experts=True)
    from vescale.plan import ParallelSpec, build

    with pytest.raises(SpecError, match=r"LoRA \(peft\) model on cp=2 is refused"):
        build(_peft_mixtral(), ParallelSpec(mesh={"cp": 2}), loss_fn=_loss, batch_size=BATCH, seq_len=SEQ)


@multi_rank(world_sizes=[4])
def test_lora_mixtral_dp2_ep2_ep2_tp2_and_pp2_ep2():
    _run("mixtral", {"dp": 2, "ep": 2})
    _run("mixtral", {"ep": 2, "tp": 2}, tp_plan="mixtral")
    _run("mixtral", {"pp": 2, "ep": 2})
