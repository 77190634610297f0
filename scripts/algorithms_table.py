"""The generated part of docs/algorithms.md: every option of conf/algo/ as its YAML says it.

    .venv/bin/python scripts/algorithms_table.py           # print it
    .venv/bin/python scripts/algorithms_table.py --write   # replace it in docs/algorithms.md

A row per option: the first sentence of its YAML's opening comment, its class, and the values that tell the
algorithms apart. A new algorithm is its class and its YAML; this script writes its row, the README's `algo` row
points here, and tests/test_readme.py fails until docs/algorithms.md holds what this script writes.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omegaconf import OmegaConf  # noqa: E402

from rlmm.config.options import CONF_DIR, group_options  # noqa: E402
from scripts import generated_part  # noqa: E402

DOC = ROOT / "docs" / "algorithms.md"
BEGIN, END = generated_part.markers("algorithms_table.py")
# The values that tell the algorithms apart, in the table's column order (a YAML without one shows –); a dotted
# name is a key of a nested option (the objective's clip range), a nested option itself shows its class.
COLUMNS = ("normalize_std", "objective", "objective.clip_low", "objective.clip_high", "loss_aggregation", "minibatches",
           "kl_coef")


def summary(option: str) -> str:
    """The first sentence of the YAML's opening comment (the lines before its first key)."""
    text = generated_part.opening_comment(CONF_DIR / "algo" / f"{option}.yaml")
    end = re.search(r"(?<!\bal)(?<!e\.g)(?<!i\.e)\.(\s|$)", text)  # "et al." ends no sentence
    return (text if end is None else text[:end.start() + 1]).replace("|", "\\|")


def cell(node: dict, column: str) -> str:
    """The YAML's value at `column` as the table shows it."""
    value = node
    for key in column.split("."):
        value = value.get(key, "–") if isinstance(value, dict) else "–"
    if isinstance(value, dict):
        return f"`{value['_target_'].rsplit('.', 1)[1]}`"
    return str(value).lower() if isinstance(value, bool) else str(value)


def generated() -> str:
    lines = [BEGIN, "", "| `algo=` | what it is | class | " + " | ".join(f"`{c}`" for c in COLUMNS) + " |",
             "|---|---|---|" + "---|" * len(COLUMNS)]
    for option in group_options("algo"):
        node = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "algo" / f"{option}.yaml"))
        cls = node["_target_"].rsplit(".", 1)[1]
        values = " | ".join(cell(node, c) for c in COLUMNS)
        lines.append(f"| `{option}` | {summary(option)} | `{cls}` | {values} |")
    return "\n".join([*lines, "", END])


def written() -> str:
    """The generated part as docs/algorithms.md holds it now ('' if it has none)."""
    return generated_part.written(DOC, "algorithms_table.py")


if __name__ == "__main__":
    generated_part.main(DOC, "algorithms_table.py", generated, __doc__.splitlines()[0])
