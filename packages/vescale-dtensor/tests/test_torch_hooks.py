"""Importing vescale.dtensor leaves torch as shipped; its hooks are installed on first use, once."""

from __future__ import annotations

import subprocess
import sys

# Runs in a fresh interpreter: the pytest process has long since used vescale.dtensor.
_CHECK = """
import torch
from torch.distributed.tensor import DTensor
from vescale.core import torch_internals as ti

aten = torch.ops.aten
ctx = ti.ExplicitRedistributionContext
torch_hook = ctx.__dict__["observe_redistribution"]
handlers = dict(ti.dtensor_custom_op_handlers())
strategies = dict(ti.sharding_propagator().op_strategy_funcs)
single_dim = dict(ti.sharding_propagator().op_single_dim_strategy_funcs)
schema_info = dict(ti.sharding_propagator().op_to_schema_info)
sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default

import vescale.dtensor
from vescale.dtensor import _torch_hooks

assert ctx.__dict__["observe_redistribution"] is torch_hook, "strict hook installed at import"
assert ti.dtensor_custom_op_handlers() == handlers, "op handlers changed at import"
assert ti.sharding_propagator().op_strategy_funcs == strategies, "sharding strategies changed at import"
assert not _torch_hooks.is_installed()

_torch_hooks.install()
hook = ctx.__dict__["observe_redistribution"]
table = dict(ti.sharding_propagator().op_strategy_funcs)
assert hook is not torch_hook and hook.__func__.__module__ == "vescale.dtensor.strict"
assert sdpa in table and sdpa not in strategies
assert getattr(table[aten.view.default], "_vescale_wrapped", False)

_torch_hooks.install()  # idempotent
assert ctx.__dict__["observe_redistribution"] is hook
assert ti.sharding_propagator().op_strategy_funcs == table

ops = _torch_hooks.installed_ops()
assert ops[sdpa] == ("op_strategy_funcs",)
assert ops[aten.copy_.default] == ("custom_op_handlers",)
assert set(ops[aten.view.default]) == {"custom_op_handlers", "op_strategy_funcs"}
assert set(ops[aten.linalg_solve_triangular.default]) == {"op_single_dim_strategy_funcs", "op_strategy_funcs"}

_torch_hooks.uninstall()  # torch's own tables again
assert not _torch_hooks.is_installed()
assert ti.dtensor_custom_op_handlers() == handlers, "uninstall left handlers"
assert ti.sharding_propagator().op_strategy_funcs == strategies, "uninstall left strategies"
assert ti.sharding_propagator().op_single_dim_strategy_funcs == single_dim, "uninstall left single-dim rules"
assert ti.sharding_propagator().op_to_schema_info == schema_info, "uninstall left schema infos"

_torch_hooks.install()  # and back
assert getattr(ti.sharding_propagator().op_strategy_funcs[aten.view.default], "_vescale_wrapped", False)
assert sdpa in ti.sharding_propagator().op_strategy_funcs
assert _torch_hooks.installed_ops() == ops
print("ok")
"""


def test_import_patches_nothing_and_install_is_idempotent():
    run = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"
