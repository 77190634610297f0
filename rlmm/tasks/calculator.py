"""Arithmetic with a calculator tool: the built-in multi-turn task (rlmm/tasks/environment.py)."""
from __future__ import annotations

import random
import re

from rlmm.tasks.arithmetic import OPERATIONS, _check_int, _in_test_split
from rlmm.tasks.base import Example, check_request
from rlmm.tasks.environment import Reply, TerseCalls, ToolCall, ToolEnvironment
from rlmm.tasks.tools import calculator

_LEADING_INT = re.compile(r"-?[0-9]+")
OPERANDS = (2, 3)


class CalculatorTask:
    """Integer arithmetic a tiny model cannot do in its head, with a calculator it can call, e.g.
    ``"(37*48)+12="`` with answer ``"1788"``.

    The prompt is ``f"{a}{op}{b}="`` (two operands) or ``f"({a}{op1}{b}){op2}{c}="`` (three: the brackets fix the
    order), operands drawn uniformly from ``[min_value, max_value]`` and operations from ``operations``. Each
    problem belongs to one split by a stable hash of its prompt, as in `ArithmeticTask`.

    The environment: a turn that is a call ``calc(EXPRESSION)`` is answered by the calculator (rlmm/tasks/tools.py:
    its result, or its error as text); any other turn is the answer, which ends the conversation; at most
    `max_turns` policy turns (a conversation still calling the calculator at its last turn has no answer: reward 0),
    and while the next prompt and a whole turn fit `max_context_tokens` tokens.
    Reward: 1.0 when the answer, stripped, starts with the result as a whole integer (as `ArithmeticTask`).

    Demonstrations (what a built-in model warm-starts on): one calculator call per operation, in order, then the
    answer: ``calc(37*48)`` -> ``1776`` -> ``calc(1776+12)`` -> ``1788`` -> ``1788``. With probability
    `direct_demos` the teacher answers at once, in the first turn (right: worked out in the head, which a model of
    a few million parameters cannot imitate), so a warm-started model calls the tool on some problems and guesses
    on the others: what RL with this task's reward can fix. The teacher's coin comes from its own stream seeded by
    `seed`, one draw per `demonstration()` call.
    """

    tools = None  # the built-in models' template lists no tools: their calls are learned from the demonstrations
    # the environment's limits: they change no demonstration, so they do not name a warm-started model
    environment_keys = ("max_turns", "max_context_tokens", "tool_timeout_s")

    def __init__(self, seed: int, min_value: int, max_value: int, operations: list[str], operands: int,
                 direct_demos: float, max_turns: int, max_context_tokens: int, tool_timeout_s: float):
        self.seed = _check_int("seed", seed)
        self.min_value, self.max_value = _check_int("min_value", min_value), _check_int("max_value", max_value)
        if self.min_value > self.max_value:
            raise ValueError(f"task.min_value: {min_value} is greater than task.max_value {max_value}")
        if isinstance(operations, str) or not operations or any(op not in OPERATIONS for op in operations):
            raise ValueError(f"task.operations: {operations!r} must be a non-empty list of "
                             f"{', '.join(OPERATIONS)}")
        self.operations = tuple(operations)
        if operands not in OPERANDS:
            raise ValueError(f"task.operands: {operands!r} (allowed: {', '.join(map(str, OPERANDS))})")
        self.operands = operands
        if isinstance(direct_demos, bool) or not isinstance(direct_demos, (int, float)) \
                or not 0.0 <= direct_demos <= 1.0:
            raise ValueError(f"task.direct_demos: expected a probability in [0, 1], got {direct_demos!r}")
        self.direct_demos = float(direct_demos)
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"task.max_turns: must be an integer >= 1, got {max_turns!r} (a turn is one response "
                             f"of the policy)")
        self.max_turns = max_turns
        if isinstance(max_context_tokens, bool) or not isinstance(max_context_tokens, int) or max_context_tokens < 1:
            raise ValueError(f"task.max_context_tokens: must be an integer >= 1, got {max_context_tokens!r}")
        self.max_context_tokens = max_context_tokens
        if not (isinstance(tool_timeout_s, (int, float)) and tool_timeout_s > 0):
            raise ValueError(f"task.tool_timeout_s: must be > 0, got {tool_timeout_s!r}")
        self.environment = ToolEnvironment({"calc": calculator}, TerseCalls(), float(tool_timeout_s))
        self._teacher = random.Random(f"{self.seed}:direct-teacher")

    def examples(self, split: str, n: int) -> list[Example]:
        check_request(split, n)
        rng = random.Random(f"{self.seed}:{split}")
        want_test = split == "test"
        out = []
        while len(out) < n:
            values = [rng.randint(self.min_value, self.max_value) for _ in range(self.operands)]
            ops = [rng.choice(self.operations) for _ in range(self.operands - 1)]
            example = self._make(values, ops)
            if _in_test_split(example.prompt) == want_test:
                out.append(example)
        return out

    def _make(self, values: list[int], ops: list[str]) -> Example:
        first = f"{values[0]}{ops[0]}{values[1]}"
        prompt = f"{first}=" if len(values) == 2 else f"({first}){ops[1]}{values[2]}="
        return Example(prompt=prompt, answer=str(self._steps(prompt)[-1][1]))

    @staticmethod
    def _steps(prompt: str) -> list[tuple[str, int]]:
        """[(the call's expression, its value)] in the order a demonstration makes them."""
        match = re.fullmatch(r"\(?(-?[0-9]+)([+*-])(-?[0-9]+)\)?(?:([+*-])(-?[0-9]+))?=", prompt)
        a, op, b, op2, c = match.groups()
        first = OPERATIONS[op](int(a), int(b))
        steps = [(f"{a}{op}{b}", first)]
        if op2 is not None:
            steps.append((f"{first}{op2}{c}", OPERATIONS[op2](first, int(c))))
        return steps

    def first_messages(self, example: Example) -> list[dict]:
        return [{"role": "user", "content": example.prompt}]

    def reply(self, example: Example, messages: list[dict]) -> Reply:
        return self.environment.reply(messages)

    def reward(self, example: Example, completion: str) -> float:
        if not isinstance(completion, str):
            return 0.0
        match = _LEADING_INT.match(completion.strip())
        return 1.0 if match is not None and match.group() == example.answer else 0.0

    def demonstration(self, example: Example) -> list[dict]:
        messages = self.first_messages(example)
        if self.direct_demos and self._teacher.random() < self.direct_demos:
            return messages + [{"role": "assistant", "content": example.answer}]
        for expression, value in self._steps(example.prompt):
            messages.append({"role": "assistant", "content": self.environment.calls.write(ToolCall("calc", expression))})
            messages.append({"role": "tool", "content": str(value)})
        return messages + [{"role": "assistant", "content": example.answer}]
