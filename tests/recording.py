"""A task that writes down which rank rewarded which prompt, for the tests (selected with
`task._target_=tests.recording.RecordedArithmetic +task.record_dir=DIR`): every `reward` call appends
the prompt to DIR/rank<RANK>.txt, so a test can see how a run split its prompts over the ranks."""
from __future__ import annotations

import os
from pathlib import Path

from rlmm.tasks.arithmetic import ArithmeticTask
from rlmm.tasks.calculator import CalculatorTask


class RecordedArithmetic(ArithmeticTask):
    # Explicit signature: rlmm validates a task's config keys against its constructor's.
    def __init__(self, record_dir: str, seed: int, min_value: int, max_value: int, operations: list[str],
                 careless_demos: float):
        super().__init__(seed=seed, min_value=min_value, max_value=max_value, operations=operations,
                         careless_demos=careless_demos)
        self.record = Path(record_dir) / f"rank{os.environ.get('RANK', '0')}.txt"

    def reward(self, example, completion):
        with self.record.open("a") as out:
            out.write(example.prompt + "\n")
        return super().reward(example, completion)


class RecordedDraws(ArithmeticTask):
    """Writes every (prompt, completion) it rewards to `record_file`, in order (selected with
    `task._target_=tests.recording.RecordedDraws +task.record_file=PATH`): what a run sampled and when."""

    def __init__(self, record_file: str, seed: int, min_value: int, max_value: int, operations: list[str],
                 careless_demos: float):
        super().__init__(seed=seed, min_value=min_value, max_value=max_value, operations=operations,
                         careless_demos=careless_demos)
        self.record = Path(record_file)

    def reward(self, example, completion):
        with self.record.open("a") as out:
            out.write(f"{example.prompt}\t{completion!r}\n")
        return super().reward(example, completion)


class RepeatedPromptDraws(ArithmeticTask):
    """Training prompts whose second is a copy of the first (so a step of 4 prompts over 2 ranks gives both
    ranks the same prompt), each rank writing every (prompt, completion) it rewards to DIR/rank<RANK>.txt
    (selected with `task._target_=tests.recording.RepeatedPromptDraws +task.record_dir=DIR`)."""

    def __init__(self, record_dir: str, seed: int, min_value: int, max_value: int, operations: list[str],
                 careless_demos: float):
        super().__init__(seed=seed, min_value=min_value, max_value=max_value, operations=operations,
                         careless_demos=careless_demos)
        self.record = Path(record_dir) / f"rank{os.environ.get('RANK', '0')}.txt"

    def examples(self, split, n):
        examples = super().examples(split, n)
        return examples[:1] * 2 + examples[2:] if split == "train" else examples

    def reward(self, example, completion):
        with self.record.open("a") as out:
            out.write(f"{example.prompt}\t{completion!r}\n")
        return super().reward(example, completion)


class ParityArithmetic(ArithmeticTask):
    """Arithmetic prompts rewarded by the completion's parity (odd lengths win; selected with
    `task._target_=tests.recording.ParityArithmetic`): rewards that vary inside most groups, so a CLI run of the
    tests' model moves its weights at every update (the arithmetic reward is nearly always 0 for it)."""

    def reward(self, example, completion):
        return float(len(completion) % 2)


class RecordedCalculator(CalculatorTask):
    """The calculator task writing every (split, prompt, answer) it rewards to DIR/rank<RANK>.txt (selected with
    `task=calculator task._target_=tests.recording.RecordedCalculator +task.record_dir=DIR`)."""

    def __init__(self, record_dir: str, seed: int, min_value: int, max_value: int, operations: list[str],
                 operands: int, direct_demos: float, max_turns: int, max_context_tokens: int, tool_timeout_s: float):
        super().__init__(seed=seed, min_value=min_value, max_value=max_value, operations=operations,
                         operands=operands, direct_demos=direct_demos, max_turns=max_turns,
                         max_context_tokens=max_context_tokens, tool_timeout_s=tool_timeout_s)
        self.record = Path(record_dir) / f"rank{os.environ.get('RANK', '0')}.txt"

    def reward(self, example, completion):
        from rlmm.tasks.arithmetic import _in_test_split

        with self.record.open("a") as out:
            out.write(f"{'test' if _in_test_split(example.prompt) else 'train'}\t{example.prompt}\t{completion!r}\n")
        return super().reward(example, completion)
