"""``pytest --cpu-durations``: a test's CPU seconds include its pooled ranks and the child processes it waited for
(while the test process itself only waits)."""

from __future__ import annotations

import subprocess
import sys

from vescale.core.testing import run_on_ranks
from vescale.core.testing.plugin import _cpu_now

BURN_S = 0.5
# /proc and os.times count in clock ticks (10 ms): a reading of one process is low by at most 0.01 s.
TICK_SLACK_S = 0.05


def _burn(seconds: float) -> None:
    import time

    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_pooled_ranks_cpu_is_counted():
    run_on_ranks(_burn, 2, 0.0)  # the pool starts outside the measurement
    before = _cpu_now()
    run_on_ranks(_burn, 2, BURN_S)
    spent = _cpu_now() - before
    assert spent >= 2 * BURN_S - TICK_SLACK_S, f"2 ranks burnt {BURN_S} s each, counted {spent:.2f} s"


def test_reaped_child_processes_cpu_is_counted():
    code = f"import time\nend = time.process_time() + {BURN_S}\nwhile time.process_time() < end: pass"
    before = _cpu_now()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    spent = _cpu_now() - before
    assert spent >= BURN_S - TICK_SLACK_S, f"a child burnt {BURN_S} s, counted {spent:.2f} s"
