"""Walk execution: the interpreter that runs one walk of one request over its plan, as
coroutines resumed by a trampoline. Workers run it over their own engines, a whole walk or, for
a walk whose nodes span ranks, their segment of it (``segment.py``)."""

from mstar_async.walks.run import OUTPUT_WINDOW, WalkRun, WalkSink
from mstar_async.walks.trampoline import (
    Condition,
    Flag,
    StepRequest,
    Task,
    TaskGroup,
    Trampoline,
)

__all__ = [
    "OUTPUT_WINDOW",
    "Condition",
    "Flag",
    "StepRequest",
    "Task",
    "TaskGroup",
    "Trampoline",
    "WalkRun",
    "WalkSink",
]
