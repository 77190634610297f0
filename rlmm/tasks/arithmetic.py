"""Synthetic integer arithmetic: the smallest task with a verifiable reward."""

import hashlib
import itertools
import random
import re

from rlmm.tasks.base import Example, check_request

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
TEST_PERCENT = 10  # share of the problem space held out for the test split

_LEADING_INT = re.compile(r"-?[0-9]+")  # ASCII digits only: "٤٦" is not 46


def _in_test_split(problem: str) -> bool:
    # A stable hash (not Python's salted hash()) so the held-out problems are the
    # same in every process and for every seed: runs with different seeds are
    # evaluated on the same test problems and never train on them.
    digest = hashlib.blake2b(problem.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 100 < TEST_PERCENT


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"task.{name}: expected an integer, got {value!r}")
    return value


class ArithmeticTask:
    """Two-operand integer arithmetic, e.g. prompt ``"23+23="`` with answer ``"46"``.

    Prompt format: ``f"{a}{op}{b}="`` with no spaces, chosen to be short for a
    character-level tiny model; ``a`` and ``b`` are drawn uniformly from
    ``[min_value, max_value]`` and ``op`` uniformly from ``operations`` (any of
    ``+``, ``-``, ``*``). The answer is
    ``str(result)``, negative for ``-`` when ``b > a``; the target completion is the
    answer itself.

    Splits: each distinct problem belongs to exactly one split, decided by a stable
    hash of its prompt (about 10% go to test), so train and test never share a
    problem. ``examples(split, n)`` draws problems i.i.d. (repeats are possible)
    from a ``random.Random`` seeded with ``(seed, split)``; a larger ``n`` extends
    the list a smaller ``n`` returns.

    Reward: 1.0 when the completion, stripped of whitespace, starts with the answer
    as a whole integer: ``"46"``, ``" 46\\n"`` and ``"46 because..."`` are correct,
    ``"467"``, ``"046"`` and ``"= 46"`` are not.

    Demonstrations (``target()``, what a model is warm-started on): with probability
    ``careless_demos`` a demonstration comes from a careless teacher who forgets the
    carry out of the units digit (``+``) or the borrow into it (``-``): ``"27+15="``
    gets ``"32"``, ``"42-15="`` gets ``"37"``; problems without a carry or borrow stay
    right. A model warm-started on them half-learns both habits, which is what RL
    with this task's exact reward can fix on problems it never saw (issue 3: at the
    built-in model's size, RL gains nothing held-out from exact demonstrations).
    The teacher's coin comes from its own stream seeded by ``seed``, one draw per
    ``target()`` call, so a warm start is reproducible.
    """

    def __init__(self, seed: int, min_value: int, max_value: int, operations: list[str], careless_demos: float):
        self.seed = _check_int("seed", seed)
        if isinstance(careless_demos, bool) or not isinstance(careless_demos, (int, float)) \
                or not 0.0 <= careless_demos <= 1.0:
            raise ValueError(f"task.careless_demos: expected a probability in [0, 1], got {careless_demos!r}")
        self.careless_demos = float(careless_demos)
        self._teacher = random.Random(f"{self.seed}:careless-teacher")
        self.min_value = _check_int("min_value", min_value)
        self.max_value = _check_int("max_value", max_value)
        if self.min_value > self.max_value:
            raise ValueError(
                f"task.min_value: {self.min_value} is greater than "
                f"task.max_value {self.max_value} (need min_value <= max_value)"
            )
        if isinstance(operations, str):  # "+-" would otherwise be read char by char
            raise ValueError(
                f"task.operations: expected a list of operations, got the string {operations!r} "
                f"(allowed: {', '.join(OPERATIONS)})"
            )
        ops = tuple(operations)  # Hydra passes a ListConfig
        if not ops:
            raise ValueError(f"task.operations: empty list (allowed: {', '.join(OPERATIONS)})")
        for op in ops:
            if op not in OPERATIONS:
                raise ValueError(
                    f"task.operations: unknown operation {op!r} (allowed: {', '.join(OPERATIONS)})"
                )
        if len(set(ops)) != len(ops):
            raise ValueError(f"task.operations: duplicate operation in {list(ops)} (allowed: each once)")
        self.operations = ops
        self._check_both_splits_nonempty()

    def _problems(self):
        values = range(self.min_value, self.max_value + 1)
        for a, op, b in itertools.product(values, self.operations, values):
            yield f"{a}{op}{b}="

    def _check_both_splits_nonempty(self) -> None:
        # Stops after a handful of problems unless the space is tiny.
        seen = set()
        for problem in self._problems():
            seen.add(_in_test_split(problem))
            if len(seen) == 2:
                return
        missing = "test" if True not in seen else "train"
        raise ValueError(
            f"task.max_value: range [{self.min_value}, {self.max_value}] with operations "
            f"{list(self.operations)} is too small to give the {missing} split any problem "
            f"(widen the range or add operations)"
        )

    def _make(self, a: int, op: str, b: int) -> Example:
        return Example(prompt=f"{a}{op}{b}=", answer=str(OPERATIONS[op](a, b)))

    def examples(self, split: str, n: int) -> list[Example]:
        check_request(split, n)
        rng = random.Random(f"{self.seed}:{split}")
        want_test = split == "test"
        out = []
        while len(out) < n:
            a = rng.randint(self.min_value, self.max_value)
            op = rng.choice(self.operations)
            b = rng.randint(self.min_value, self.max_value)
            example = self._make(a, op, b)
            if _in_test_split(example.prompt) == want_test:
                out.append(example)
        return out

    def reward(self, example: Example, completion: str) -> float:
        if not isinstance(completion, str):
            return 0.0
        match = _LEADING_INT.match(completion.strip())
        # The regex is greedy, so "467" yields "467" and fails against "46".
        return 1.0 if match is not None and match.group() == example.answer else 0.0

    def target(self, example: Example) -> str:
        if self.careless_demos and self._teacher.random() < self.careless_demos:
            return forget_carry(example.prompt)
        return example.answer


def forget_carry(prompt: str) -> str:
    """The answer to `prompt` ("a+b=" or "a-b=") with the units digit's carry or borrow forgotten
    (the right answer when there is none; `*` and negative operands are answered right)."""
    match = re.fullmatch(r"(-?[0-9]+)([+*-])(-?[0-9]+)=", prompt)
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    exact = OPERATIONS[op](a, b)
    if a < 0 or b < 0:
        return str(exact)
    if op == "+" and a % 10 + b % 10 >= 10:
        return str(exact - 10)
    if op == "-" and max(a, b) % 10 < min(a, b) % 10:
        return str(exact + 10 if a >= b else exact - 10)  # the forgotten borrow leaves |a - b| 10 too big
    return str(exact)
