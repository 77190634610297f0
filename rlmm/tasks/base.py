"""The task interface: prompts with verifiable rewards.

A task is a plain class that Hydra builds from a YAML ``_target_``; its constructor
signature is its config schema. Every task provides

- ``examples(split, n) -> list[Example]``: ``split`` is ``"train"`` or ``"test"``;
  deterministic given the task's ``seed``.
- ``reward(example, completion) -> float``: 1.0 if the completion is correct, else 0.0;
  never raises on any string.
- ``target(example) -> str``: the completion a perfect policy would write (for the
  supervised warm start), without an end-of-sequence token.
"""

from dataclasses import dataclass

SPLITS = ("train", "test")


@dataclass(frozen=True)
class Example:
    prompt: str  # text fed to the model as-is
    answer: str  # canonical answer string (e.g. "46")


def check_request(split: str, n: int) -> None:
    """Shared argument check for ``examples(split, n)``."""
    if split not in SPLITS:
        raise ValueError(f"task: unknown split {split!r} (allowed: {', '.join(SPLITS)})")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"task: number of examples must be an integer >= 1, got {n!r}")
