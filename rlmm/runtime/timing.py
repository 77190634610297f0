"""Wall-clock timing of named stages."""
from __future__ import annotations

import time
from contextlib import contextmanager


@contextmanager
def timed(seconds: dict[str, float], stage: str):
    """Add the wall-clock time of the block to `seconds[stage]`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - start
