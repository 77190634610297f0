"""The generated part of docs/corrections.md: every option of conf/correction/ as its YAML and its class say.

    .venv/bin/python scripts/corrections_table.py           # print it
    .venv/bin/python scripts/corrections_table.py --write   # replace it in docs/corrections.md

For each option: a row of the methods table (where the class acts, which pi_old it trains against, its docstring's
first line, the YAML's parameters) and a reference entry (the class docstring: formula, sources, departures). A new
correction is its class and its YAML; this script writes its documentation, and tests/test_readme.py fails until
docs/corrections.md holds what it writes.
"""
from __future__ import annotations

import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omegaconf import OmegaConf  # noqa: E402

from rlmm.config.options import CONF_DIR, from_yaml, group_options  # noqa: E402
from rlmm.corrections.base import Anchor, Correction  # noqa: E402
from scripts import generated_part  # noqa: E402

DOC = ROOT / "docs" / "corrections.md"
BEGIN, END = generated_part.markers("corrections_table.py")


def acts(cls: type) -> str:
    """Where a class acts: the methods it overrides of `Correction`'s identity."""
    where = [label for method, label in (("before_update", "batch"), ("in_update", "update"), ("step_size", "step"))
             if getattr(cls, method) is not getattr(Correction, method)]
    return " + ".join(where) or "batch (identity)"


def old_side(correction: Correction) -> str:
    if correction.replaces_old_logprobs:  # `InUpdate.old_logprobs`, in each micro-batch
        return "replaced inside the update"
    return {Anchor.sampler: "μ (sampler)", Anchor.trainer: "π_old (trainer)"}.get(correction.old_policy,
                                                                              "π_old (trainer; assumes none)")


def parameters(option: str) -> str:
    node = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "correction" / f"{option}.yaml"))
    node.pop("_target_")
    return ", ".join(f"`{k}` {v}" for k, v in node.items()) or "–"


def generated() -> str:
    options = group_options("correction")
    built = {option: from_yaml("correction", option) for option in options}
    lines = [BEGIN, "", "| `correction=` | class | acts | PPO's π_old | what it does | parameters |", "|---|---|---|---|---|---|"]
    for option, correction in built.items():
        cls = type(correction)
        summary = inspect.getdoc(cls).splitlines()[0].replace("|", "\\|")
        lines.append(f"| [`{option}`](#correction{option}) | `{cls.__name__}` | {acts(cls)} | {old_side(correction)} | "
                     f"{summary} | {parameters(option)} |")
    lines += ["", "Acts: *batch* once per batch before the update (`before_update`), *update* in each micro-batch of "
              "the update on π_θ (`in_update`), *step* on the step's learning rate (`step_size`). Any of them stack: "
              "`correction=a+b+c` (below).", "",
              "### Every method, as its class documents it", ""]
    for option, correction in built.items():
        cls = type(correction)
        lines += [f"#### correction={option}", "",
                  f"`{cls.__module__}.{cls.__name__}` (conf/correction/{option}.yaml: {parameters(option)})", "",
                  "```text", inspect.getdoc(cls), "```", ""]
    return "\n".join([*lines, END])


def written() -> str:
    """The generated part as docs/corrections.md holds it now ('' if it has none)."""
    return generated_part.written(DOC, "corrections_table.py")


if __name__ == "__main__":
    generated_part.main(DOC, "corrections_table.py", generated, __doc__.splitlines()[0])
