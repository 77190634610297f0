"""Tasks: prompts with verifiable rewards (the interface is in rlmm/tasks/base.py).

The names below are re-exported for convenience; the task modules import from
``rlmm.tasks.base``, never from this package, so there is no import cycle.
"""

from rlmm.tasks.arithmetic import ArithmeticTask
from rlmm.tasks.base import SPLITS, Example, check_request
from rlmm.tasks.gsm8k import Gsm8kTask

__all__ = ["SPLITS", "ArithmeticTask", "Example", "Gsm8kTask", "check_request"]
