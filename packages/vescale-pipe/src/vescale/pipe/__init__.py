"""vescale.pipe: pipeline parallelism for unmodified PyTorch models.

Split a model into stages by graph capture (:func:`split`) or bring your own stage modules, run them with
:class:`PipeEngine` under a schedule (``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zb_h1``, ``zbv``, or one you
register: schedules are plain per-rank instruction lists, checked by :func:`validate_schedule`), compose with TP/DP on
a named mesh (a stage's own dp reducer follows :class:`StageGradSync`), and record one nD timeline of every rank
(:mod:`vescale.pipe.timeline`). Needs only vescale.core and torch.
"""

from __future__ import annotations

from vescale.pipe import timeline
from vescale.pipe.engine import PipeEngine, split_microbatches
from vescale.pipe.errors import PipeError, ScheduleError, SplitError
from vescale.pipe.grad_sync import StageGradSync
from vescale.pipe.schedule import (
    Action,
    PipeSchedule,
    add_communication,
    build_schedule,
    looped_placement,
    register_schedule,
    schedule_names,
    v_placement,
)
from vescale.pipe.split import GraphStage, auto_split_points, capture, split
from vescale.pipe.timeline import Timeline
from vescale.pipe.validate import ScheduleReport, validate_schedule

__all__ = [
    "Action",
    "GraphStage",
    "PipeEngine",
    "PipeError",
    "PipeSchedule",
    "ScheduleError",
    "ScheduleReport",
    "SplitError",
    "StageGradSync",
    "Timeline",
    "add_communication",
    "auto_split_points",
    "build_schedule",
    "capture",
    "looped_placement",
    "register_schedule",
    "schedule_names",
    "split",
    "split_microbatches",
    "timeline",
    "v_placement",
    "validate_schedule",
]
