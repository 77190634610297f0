"""The generated part of docs/precision.md: every option of conf/quantization/ as its class and YAML say it.

    .venv/bin/python scripts/quantization_table.py           # print it
    .venv/bin/python scripts/quantization_table.py --write   # replace it in docs/precision.md

A row per mode: its YAML's opening comment, its class, what it quantizes (weights, and each linear layer's input),
its scale tensor's name and the words the run's precision report gives it (`describe()`). A new mode is its class
and its YAML; this script writes its row, the README's `quantization` row points here, and tests/test_readme.py
fails until docs/precision.md holds what this script writes.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlmm.config.options import CONF_DIR, group_options, option_node  # noqa: E402
from scripts import generated_part  # noqa: E402

DOC = ROOT / "docs" / "precision.md"
BEGIN, END = generated_part.markers("quantization_table.py")


def opening_comment(option: str) -> str:
    """The YAML's opening comment, without the module path it ends with."""
    text = generated_part.opening_comment(CONF_DIR / "quantization" / f"{option}.yaml")
    return text.removesuffix(" rlmm/policy/quantization.py").replace("|", "\\|")


def generated() -> str:
    from hydra.utils import instantiate

    lines = [BEGIN, "", "| `quantization=` | what it is | class | weights | layer inputs | scale tensor | in the precision "
             "report |", "|---|---|---|---|---|---|---|"]
    for option in group_options("quantization"):
        node = option_node("quantization", option)
        mode = instantiate(node)
        yes_no = {True: "quantized", False: "–"}
        lines.append(f"| `{option}` | {opening_comment(option)} | `{node._target_.rsplit('.', 1)[1]}` | "
                     f"{yes_no[mode.quantizes_weights]} | {'rounded' if mode.rounds_inputs else '–'} | "
                     f"{f'`{mode.scale_name}`' if mode.scale_name else '–'} | {mode.describe()} |")
    return "\n".join([*lines, "", END])


def written() -> str:
    """The generated part as docs/precision.md holds it now ('' if it has none)."""
    return generated_part.written(DOC, "quantization_table.py")


if __name__ == "__main__":
    generated_part.main(DOC, "quantization_table.py", generated, __doc__.splitlines()[0])
