"""``python -m vescale.plan``: the planner CLI (:mod:`vescale.plan.cli`)."""

from __future__ import annotations

from vescale.plan.cli import main

raise SystemExit(main())
