"""GSM8K-style grade-school math word problems (Cobbe et al. 2021, "Training
Verifiers to Solve Math Word Problems", https://github.com/openai/grade-school-math).

Each record is ``{"question": ..., "answer": "...reasoning...\\n#### 42"}``: the
answer field is a worked solution whose last line gives the final number after
``####``, the format of the original dataset.
"""

import json
import os
import random
import re
from decimal import Decimal  # exact comparison: 3.50 == 3.5, no float rounding

from rlmm.tasks.base import Example, check_request

HUB_CONFIG = "main"  # the GSM8K config name on the Hugging Face hub
TEST_FRACTION = 0.2  # held-out share of a local file
_SPLIT_SEED = "gsm8k-local-split"

# A number as written in prose: optional sign and dollar sign, thousands commas,
# decimals. ASCII digits only; the lookbehind keeps "10-5" from giving "-5" and
# "x2" from giving "2".
_NUMBER = re.compile(
    r"(?<!\w)(-)?\$?(-)?((?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?)"
)
_PLAIN_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")


def extract_reference(answer_field: str) -> str:
    """The final answer of a GSM8K solution: the text after the last ``####``,
    commas removed, stripped (``"...\\n#### 1,234"`` -> ``"1234"``)."""
    if "####" not in answer_field:
        raise ValueError("answer has no '#### <final answer>' line")
    return answer_field.rsplit("####", 1)[1].replace(",", "").strip()


def _canonical(negative: bool, digits: str) -> str:
    # Plain string surgery rather than int()/Decimal.normalize(), which fail on or
    # round very long numbers: reward() must never raise.
    whole, _, fraction = digits.replace(",", "").partition(".")
    text = (whole.lstrip("0") or "0") + ("." + fraction.rstrip("0") if fraction.rstrip("0") else "")
    return "-" + text if negative and text != "0" else text  # "-3.50" -> "-3.5", "-0" -> "0"


def extract_prediction(completion: str) -> str | None:
    """The final answer a completion states, in canonical form, or None.

    If the completion contains ``####``, the first number after the first ``####``
    (a model that keeps writing after its answer, e.g. a made-up next question, is
    judged on the answer it gave first). Otherwise the last number in the text.
    ``"The answer is $1,234."`` -> ``"1234"``; ``"-3.50"`` -> ``"-3.5"``.
    """
    if not isinstance(completion, str):
        return None
    if "####" in completion:
        match = _NUMBER.search(completion.split("####", 1)[1])
    else:
        match = None
        for match in _NUMBER.finditer(completion):
            pass
    if match is None:
        return None
    minus_before, minus_after, digits = match.groups()
    return _canonical(bool(minus_before or minus_after), digits)


def answers_match(prediction: str | None, reference: str) -> bool:
    """Numeric equality when the reference is a number, exact text otherwise."""
    if prediction is None:
        return False
    ref = reference.replace("$", "").strip()
    if _PLAIN_NUMBER.fullmatch(ref) and _PLAIN_NUMBER.fullmatch(prediction):
        return Decimal(prediction) == Decimal(ref)
    return prediction.strip() == reference.strip()


class Gsm8kTask:
    """GSM8K word problems with the final number as a verifiable answer.

    ``path`` is a local ``.jsonl`` file (one ``{"question", "answer"}`` record per
    line) or a Hugging Face dataset id such as ``openai/gsm8k`` (loaded with
    ``datasets.load_dataset(path, "main")``; without network, from the datasets cache
    that ``rlmm prefetch`` fills).

    Splits: a hub dataset keeps its own train/test splits. A local file is split
    80/20 by a shuffle with a fixed seed (at least one test record when there are two
    or more), so the test set is the same for every ``seed``.

    ``examples(split, n)`` returns the first ``n`` records of the split shuffled by a
    ``random.Random`` seeded with ``(seed, split)``; when ``n`` exceeds the split,
    that same order repeats cyclically until ``n`` examples are produced.

    The prompt is ``prompt_template.format(question=...)``; ``Example.answer`` is the
    extracted final number; ``target(example)`` is the full reference solution
    (reasoning and ``#### 42`` line) exactly as in the data.
    """

    def __init__(self, path: str, seed: int, prompt_template: str):
        if not isinstance(path, str) or not path:
            raise ValueError(f"task.path: expected a .jsonl file or a dataset id, got {path!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"task.seed: expected an integer, got {seed!r}")
        _check_template(prompt_template)
        self.path = path
        self.seed = seed
        self.prompt_template = prompt_template

        splits = _load(path)
        self._examples: dict[str, list[Example]] = {}
        self._solutions: dict[str, str] = {}
        for split, records in splits.items():
            self._examples[split] = []
            for question, solution in records:
                prompt = prompt_template.format(question=question)
                self._solutions.setdefault(prompt, solution)
                self._examples[split].append(Example(prompt, extract_reference(solution)))

    def examples(self, split: str, n: int) -> list[Example]:
        check_request(split, n)
        pool = list(self._examples[split])
        if not pool:
            raise ValueError(f"task.path: {self.path!r} has no {split} examples")
        random.Random(f"{self.seed}:{split}").shuffle(pool)
        return [pool[i % len(pool)] for i in range(n)]

    def reward(self, example: Example, completion: str) -> float:
        return 1.0 if answers_match(extract_prediction(completion), example.answer) else 0.0

    def target(self, example: Example) -> str:
        try:
            return self._solutions[example.prompt]
        except KeyError:
            raise ValueError(f"task: prompt not from {self.path!r}: {example.prompt[:60]!r}") from None


def _check_template(template: object) -> None:
    if not isinstance(template, str) or "{question}" not in template:
        raise ValueError(
            f"task.prompt_template: {template!r} must contain the field {{question}}"
        )
    try:
        template.format(question="")
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(
            f"task.prompt_template: {template!r} cannot be formatted ({err!r}); "
            "the only allowed field is {question}, write literal braces as {{ and }}"
        ) from None


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _looks_like_file(path: str) -> bool:
    # Hub ids are "name" or "owner/name"; anything else is meant as a local file.
    return path.endswith((".jsonl", ".json")) or path.startswith(("/", ".", "~")) or path.count("/") > 1


def _load(path: str) -> dict[str, list[tuple[str, str]]]:
    """{split: [(question, solution), ...]} from a local file or the hub."""
    local = os.path.expanduser(path)
    if os.path.isfile(local):
        return _split_local(_read_jsonl(local))
    if not os.path.isdir(local) and _looks_like_file(path):
        raise ValueError(
            f"task.path: file not found: {path!r} (expected a .jsonl file or a dataset id like 'openai/gsm8k')"
        )
    return _load_hub(path)  # also covers a local dataset directory


def _read_jsonl(path: str) -> list[tuple[str, str]]:
    """The file's records, read as bytes and decoded a line at a time, so that a byte that is not UTF-8 is named by
    its line and its offset in the file (the codec's own error names neither)."""
    records = []
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"task.path: {path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: not UTF-8: byte 0x{raw[err.start]:02x} at offset {offset + err.start} of "
                                 "the file (save it as UTF-8: iconv -f <its encoding> -t utf-8)") from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: invalid JSON ({err.msg})") from None
            records.append(_check_record(record, where))
    if not records:
        raise ValueError(f"task.path: {path!r} has no records")
    return records


def _check_record(record: object, where: str) -> tuple[str, str]:
    if not (
        isinstance(record, dict)
        and isinstance(record.get("question"), str)
        and isinstance(record.get("answer"), str)
    ):
        raise ValueError(f"{where}: expected an object with string fields 'question' and 'answer'")
    if "####" not in record["answer"]:
        raise ValueError(f"{where}: answer has no '#### <final answer>' line")
    return record["question"], record["answer"]


def _split_local(records: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    order = list(records)
    random.Random(_SPLIT_SEED).shuffle(order)
    n_test = max(1, round(TEST_FRACTION * len(order))) if len(order) >= 2 else 0
    return {"train": order[n_test:], "test": order[:n_test]}


def _load_hub(path: str) -> dict[str, list[tuple[str, str]]]:
    try:
        import datasets  # heavy (pyarrow): imported only for hub ids and dataset folders
    except ImportError:
        raise ValueError(
            f"task.path: {path!r} is not a local file and loading it from the Hugging Face hub "
            "needs the 'datasets' package (pip install datasets)"
        ) from None
    try:
        data = datasets.load_dataset(path, HUB_CONFIG)
    except ConnectionError:
        # The hub is unreachable (no network, or HF_DATASETS_OFFLINE / HF_HUB_OFFLINE set) and the
        # dataset is not in the datasets cache, the only place datasets then looks (docs/sweeps.md).
        raise ValueError(
            f"task.path: dataset {path!r} is not in the datasets cache ({datasets.config.HF_DATASETS_CACHE}) "
            f"and the hub cannot be reached; where there is internet, run: rlmm prefetch task=gsm8k task.path={path}"
        ) from None
    except Exception as err:  # the hub raises many types; all mean "cannot load this"
        raise ValueError(
            f"task.path: {path!r} is neither an existing file nor a loadable Hugging Face dataset "
            f"({type(err).__name__}: {_one_line(err)[:200]})"
        ) from None
    out = {}
    for split in ("train", "test"):
        if split not in data:
            raise ValueError(f"task.path: dataset {path!r} has no {split!r} split (has: {', '.join(data)})")
        out[split] = [
            _check_record(row, f"task.path: {path}[{split}][{i}]") for i, row in enumerate(data[split])
        ]
    return out
