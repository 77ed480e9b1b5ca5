"""The one registry vescale's custom operators find their states in (:mod:`vescale.parallel.collectives`): context
parallelism's cp setups and expert parallelism's operator setups share its keys, an equal state gets its key back,
and only the next key can be assigned."""

from __future__ import annotations

import pytest


def test_op_states_keys():
    import importlib

    from vescale.parallel.collectives import OP_STATES, OpStates, op_state, register_op_state

    # (the package exports functions of these modules' names: the modules themselves by import_module)
    context_parallel = importlib.import_module("vescale.parallel.context_parallel")
    experts = importlib.import_module("vescale.parallel.experts")

    assert experts._OP_SETUPS is OP_STATES  # experts_as_operator's `key = len(..); table[key] = setup` registers here
    table = OpStates()
    a, b = object(), object()
    assert (table.register(a), table.register(b), table.register(a)) == (0, 1, 0)
    table[len(table)] = "next"
    assert len(table) == 3 and table[2] == "next"
    with pytest.raises(KeyError, match="only the next key"):
        table[7] = "elsewhere"

    group = object()  # a stand-in: the setup compares its group by identity
    key = context_parallel._setup_key(context_parallel._Setup(group, 2, 1))
    assert context_parallel._setup_key(context_parallel._Setup(group, 2, 1)) == key
    assert context_parallel._setup_key(context_parallel._Setup(object(), 2, 1)) != key
    assert op_state(key).rank == 1 and register_op_state(op_state(key)) == key
