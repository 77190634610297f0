"""Tests for rlmm.tasks: determinism, splits, answers, rewards, error messages."""

import json
import re
import sys
from pathlib import Path

import pytest

from rlmm.tasks import ArithmeticTask, Example, Gsm8kTask
from rlmm.tasks.gsm8k import extract_prediction, extract_reference

SAMPLE = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"
# The values the tests start from (the tests' own, not a run's: conf/task/ holds those): exact demonstrations.
ARITHMETIC = dict(seed=0, min_value=0, max_value=99, operations=["+", "-"], careless_demos=0.0)
TEMPLATE = "Question: {question}\nAnswer: "


def arithmetic(**values) -> ArithmeticTask:
    return ArithmeticTask(**(ARITHMETIC | values))


def gsm8k(path, **values) -> Gsm8kTask:
    return Gsm8kTask(**(dict(path=str(path), seed=0, prompt_template=TEMPLATE) | values))


# --- arithmetic -------------------------------------------------------------------


def test_arithmetic_is_deterministic_per_seed():
    a, b, c = arithmetic(seed=1), arithmetic(seed=1), arithmetic(seed=2)
    for split in ("train", "test"):
        assert a.examples(split, 50) == b.examples(split, 50)
        assert a.examples(split, 50) != c.examples(split, 50)
    assert a.examples("train", 50) != a.examples("test", 50)
    # A longer request extends a shorter one.
    assert a.examples("train", 80)[:50] == a.examples("train", 50)


def test_arithmetic_train_and_test_are_disjoint():
    task = arithmetic(seed=0, min_value=0, max_value=20, operations=["+", "-", "*"])
    train = {e.prompt for e in task.examples("train", 3000)}
    test = {e.prompt for e in task.examples("test", 500)}
    assert train and test and not train & test
    # A different seed draws different problems but keeps the same held-out set.
    other_train = {e.prompt for e in arithmetic(seed=5, max_value=20, operations=["+", "-", "*"]).examples("train", 3000)}
    assert not other_train & test


def test_arithmetic_prompt_format_and_answers():
    task = arithmetic(seed=3, min_value=0, max_value=99, operations=["+", "-", "*"])
    examples = task.examples("train", 300)
    ops = set()
    for e in examples:
        match = re.fullmatch(r"([0-9]+)([-+*])([0-9]+)=", e.prompt)
        assert match, e.prompt
        a, op, b = match.groups()
        ops.add(op)
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
        assert e.answer == str(eval(e.prompt[:-1]))
        assert task.target(e) == e.answer
        assert task.reward(e, task.target(e)) == 1.0
    assert ops == {"+", "-", "*"}
    assert any(e.answer.startswith("-") for e in examples)  # "-" may go negative


def test_careless_demonstrations_forget_the_carry_and_nothing_else():
    exact, careless = arithmetic(seed=0), arithmetic(seed=0, careless_demos=1.0)
    examples = careless.examples("train", 400)
    assert examples == exact.examples("train", 400)  # the problems and their rewards do not change
    wrong = 0
    for e in examples:
        a, op, b = re.fullmatch(r"([0-9]+)([-+])([0-9]+)=", e.prompt).groups()
        a, b = int(a), int(b)
        carry = a % 10 + b % 10 >= 10 if op == "+" else max(a, b) % 10 < min(a, b) % 10
        target = careless.target(e)
        assert exact.target(e) == e.answer
        if not carry:
            assert target == e.answer, e
            continue
        wrong += 1
        assert careless.reward(e, target) == 0.0
        assert abs(int(target) - int(e.answer)) == 10, (e, target)  # off by the forgotten ten only
    assert wrong > 100
    assert {arithmetic(seed=0, max_value=9, operations=["*"], careless_demos=1.0).target(Example("7*8=", "56"))} == {"56"}
    assert arithmetic(min_value=-9, careless_demos=1.0).target(Example("-3+9=", "6")) == "6"


def test_careless_share_and_reproducibility():
    def demos(seed):
        task = arithmetic(seed=seed, careless_demos=0.5)
        return [task.target(e) for e in task.examples("train", 2000)]

    examples = arithmetic(seed=0).examples("train", 2000)
    first = demos(0)
    assert first == demos(0) and first != demos(1)  # the teacher's coin is seeded
    carry_rows = [i for i, e in enumerate(examples) if arithmetic(seed=0, careless_demos=1.0).target(e) != e.answer]
    share = sum(first[i] != examples[i].answer for i in carry_rows) / len(carry_rows)
    assert 0.45 < share < 0.55  # half the demonstrations of carry problems are careless


@pytest.mark.parametrize("value", [-0.1, 1.5, "half", True])
def test_careless_demos_out_of_range_is_one_line(value):
    with pytest.raises(ValueError, match=r"^task.careless_demos: expected a probability in \[0, 1\], got "):
        arithmetic(careless_demos=value)


def test_arithmetic_negative_operands():
    task = arithmetic(min_value=-5, max_value=5, operations=["-", "*"])
    for e in task.examples("train", 50):
        assert e.answer == str(eval(e.prompt[:-1].replace("--", "- -").replace("*-", "* -")))


def test_arithmetic_accepts_tuple_like_operations():
    class ListConfigLike:  # what Hydra passes: a sequence that is not a list
        def __iter__(self):
            return iter(["*"])

    task = arithmetic(operations=ListConfigLike(), min_value=2, max_value=5)
    assert all("*" in e.prompt for e in task.examples("train", 20))


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("46", 1.0),
        ("46 ", 1.0),
        ("  46\n", 1.0),
        ("46\n12+3=15", 1.0),
        ("46 because 23+23", 1.0),
        ("46.", 1.0),
        ("467", 0.0),
        ("046", 0.0),
        ("45", 0.0),
        ("-46", 0.0),
        ("= 46", 0.0),
        ("forty-six", 0.0),
        ("", 0.0),
        ("   ", 0.0),
        ("٤٦", 0.0),  # Arabic-Indic digits are not the ASCII answer
        ("\x00\ud800🙂46", 0.0),
        ("46\ud800", 1.0),
    ],
)
def test_arithmetic_reward(completion, expected):
    task = arithmetic()
    assert task.reward(Example("23+23=", "46"), completion) == expected


@pytest.mark.parametrize(
    "completion, expected", [("-13", 1.0), ("-13\n", 1.0), ("13", 0.0), ("-130", 0.0), ("- 13", 0.0), ("-", 0.0)]
)
def test_arithmetic_reward_negative(completion, expected):
    assert arithmetic().reward(Example("5-18=", "-13"), completion) == expected


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"operations": ["+", "/"]}, "task.operations: unknown operation '/' (allowed: +, -, *)"),
        ({"operations": []}, "task.operations: empty list (allowed: +, -, *)"),
        ({"operations": "+-"}, "task.operations:"),
        ({"operations": ["+", "+"]}, "task.operations: duplicate"),
        ({"min_value": 10, "max_value": 3}, "task.min_value: 10 is greater than task.max_value 3"),
        ({"max_value": "99"}, "task.max_value: expected an integer, got '99'"),
        ({"min_value": 0, "max_value": 0, "operations": ["+"]}, "too small"),
    ],
)
def test_arithmetic_bad_arguments(kwargs, message):
    with pytest.raises(ValueError) as info:
        arithmetic(**kwargs)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("task", [arithmetic(), gsm8k(SAMPLE)], ids=["arithmetic", "gsm8k"])
@pytest.mark.parametrize(
    "split, n, message",
    [
        ("valid", 3, "task: unknown split 'valid' (allowed: train, test)"),
        ("train", 0, "task: number of examples must be an integer >= 1, got 0"),
        ("test", -2, "got -2"),
    ],
)
def test_bad_examples_request(task, split, n, message):
    with pytest.raises(ValueError, match=None) as info:
        task.examples(split, n)
    assert message in str(info.value)


# --- gsm8k ------------------------------------------------------------------------


def test_gsm8k_loads_sample_file():
    task = gsm8k(SAMPLE, seed=0)
    n_records = sum(1 for line in SAMPLE.read_text().splitlines() if line.strip())
    train = task.examples("train", 100)
    test = task.examples("test", 100)
    distinct_train = {e.prompt for e in train}
    distinct_test = {e.prompt for e in test}
    assert len(distinct_train) + len(distinct_test) == n_records
    assert len(distinct_test) == round(0.2 * n_records)
    assert not distinct_train & distinct_test
    e = train[0]
    assert e.prompt.startswith("Question: ") and e.prompt.endswith("\nAnswer: ")
    for e in train + test:
        solution = task.target(e)
        assert extract_reference(solution) == e.answer
        assert "####" in solution and "####" not in e.answer
        assert task.reward(e, solution) == 1.0
        assert task.reward(e, "I don't know") == 0.0
    assert {"1250", "3.5", "-5"} <= {e.answer for e in train + test}


def test_gsm8k_examples_deterministic_and_cycling():
    a, b, c = gsm8k(SAMPLE, seed=0), gsm8k(SAMPLE, seed=0), gsm8k(SAMPLE, seed=1)
    assert a.examples("train", 9) == b.examples("train", 9)
    assert a.examples("train", 9) != c.examples("train", 9)
    # The held-out records do not depend on the seed.
    assert {e.prompt for e in a.examples("test", 5)} == {e.prompt for e in c.examples("test", 5)}
    first = a.examples("train", 9)
    assert len(set(first)) == 9
    assert a.examples("train", 20) == first + first + first[:2]


def test_gsm8k_prompt_template():
    task = gsm8k(SAMPLE, prompt_template="Q: {question}\nA: {{think}}")
    assert all(e.prompt.startswith("Q: ") and e.prompt.endswith("\nA: {think}") for e in task.examples("train", 5))


@pytest.mark.parametrize(
    "template, message",
    [("Question:", "task.prompt_template: 'Question:' must contain the field {question}"),
     ("{question} {other}", "the only allowed field is {question}")],
)
def test_gsm8k_bad_template(template, message):
    with pytest.raises(ValueError) as info:
        gsm8k(SAMPLE, prompt_template=template)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_gsm8k_small_files(tmp_path):
    record = {"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"}
    two = tmp_path / "two.jsonl"
    two.write_text(json.dumps(record) + "\n\n" + json.dumps({**record, "question": "Again?"}) + "\n")
    task = gsm8k(two)
    assert len({e.prompt for e in task.examples("test", 4)}) == 1
    assert len({e.prompt for e in task.examples("train", 4)}) == 1
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match="has no test examples"):
        gsm8k(one).examples("test", 1)


def test_gsm8k_missing_file_error_is_one_line():
    path = "/nonexistent/dir/gsm8k_train.jsonl"
    with pytest.raises(ValueError) as info:
        gsm8k(path)
    message = str(info.value)
    assert "\n" not in message and path in message and message.startswith("task.path: file not found")


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "has no records"),
        ("{not json\n", ":1: invalid JSON"),
        ('{"question": "Q?"}\n', ":1: expected an object with string fields 'question' and 'answer'"),
        ('{"question": "Q?", "answer": "2"}\n', ":1: answer has no '#### <final answer>' line"),
    ],
)
def test_gsm8k_bad_file(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        gsm8k(path)
    assert message in str(info.value) and str(path) in str(info.value) and "\n" not in str(info.value)


def test_gsm8k_file_not_in_utf8_names_its_line_and_byte(tmp_path):
    """A file saved as Latin-1 (issue 50, case 9): a UnicodeDecodeError from the codec, whose traceback named
    neither the file nor the line; now one line naming both and the byte's offset in the file."""
    first = json.dumps({"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"}) + "\n"
    second = '{"question": "Combien co\u00fbte 2 + 2?", "answer": "#### 4"}\n'
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(first.encode() + second.encode("latin-1"))
    offset = len(first) + second.index("\u00fb")
    with pytest.raises(ValueError) as info:
        gsm8k(path)
    assert str(info.value) == (f"task.path: {path}:2: not UTF-8: byte 0xfb at offset {offset} of the file (save it as "
                               "UTF-8: iconv -f <its encoding> -t utf-8)")


def test_gsm8k_hub_id_without_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ValueError) as info:
        gsm8k("openai/gsm8k")
    message = str(info.value)
    assert "pip install datasets" in message and "openai/gsm8k" in message and "\n" not in message


def test_gsm8k_hub_loading_error_is_one_line(monkeypatch):
    class FakeDatasets:
        @staticmethod
        def load_dataset(path, name):
            raise FileNotFoundError(f"Couldn't find '{path}' on the Hub.\nPlease check the name.")

    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets)
    with pytest.raises(ValueError) as info:
        gsm8k("nobody/nothing")
    message = str(info.value)
    assert "\n" not in message and "'nobody/nothing' is neither an existing file" in message


def test_gsm8k_hub_splits(monkeypatch):
    rows = {
        "train": [{"question": f"q{i}", "answer": f"w\n#### {i}"} for i in range(5)],
        "test": [{"question": "t", "answer": "#### 1,000"}],
    }

    class FakeDatasets:
        @staticmethod
        def load_dataset(path, name):
            assert (path, name) == ("openai/gsm8k", "main")
            return rows

    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets)
    task = gsm8k("openai/gsm8k")
    assert {e.answer for e in task.examples("train", 5)} == {"0", "1", "2", "3", "4"}
    assert task.examples("test", 2) == [Example("Question: t\nAnswer: ", "1000")] * 2


@pytest.mark.parametrize(
    "answer_field, expected",
    [("#### 42", "42"), ("a\nb\n#### 1,234", "1234"), ("x #### 1\n#### -7 ", "-7"), ("#### 3.5", "3.5")],
)
def test_extract_reference(answer_field, expected):
    assert extract_reference(answer_field) == expected


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("The answer is $1,234.", "1234"),
        ("#### 42", "42"),
        ("so 6 * 7 = 42\n#### 42\n\nQuestion: 5 apples", "42"),  # first answer, not later text
        ("#### $1,250.00", "1250"),
        ("It costs 3.50 dollars.", "3.5"),
        ("The temperature is -5 degrees.", "-5"),
        ("She owes -$12.", "-12"),
        ("10-5", "5"),
        ("first 3, then 4, so 7", "7"),
        ("x2", None),
        ("007.250", "7.25"),
        ("-0.0", "0"),
        ("9" * 5000, "9" * 5000),  # longer than int() will print
        ("####", None),
        ("no numbers here", None),
        ("", None),
        ("٤٢", None),
    ],
)
def test_extract_prediction(completion, expected):
    assert extract_prediction(completion) == expected


@pytest.mark.parametrize(
    "answer, completion, expected",
    [
        ("42", "#### 42", 1.0),
        ("42", "The answer is 42.", 1.0),
        ("42", "#### 42.0", 1.0),
        ("42", "The answer is 420.", 0.0),
        ("1234", "The answer is $1,234.", 1.0),
        ("3.5", "It costs 3.50", 1.0),
        ("3.50", "#### 3.5", 1.0),
        ("-5", "It is -5 degrees", 1.0),
        ("-5", "It is 5 degrees", 0.0),
        ("42", "", 0.0),
        ("42", "\ud800\x00🙂", 0.0),
        ("42", "#### forty-two", 0.0),
    ],
)
def test_gsm8k_reward(answer, completion, expected):
    task = gsm8k(SAMPLE)
    assert task.reward(Example("p", answer), completion) == expected
