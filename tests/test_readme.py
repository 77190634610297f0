"""The README's config table names every option of every group it lists (its `algo` row once listed two of
five algorithms): a new option YAML fails here until the table shows it; the corrections and the algorithms, listed
by tables generated from their classes and YAMLs (docs/corrections.md, docs/algorithms.md), fail here until their
table is written again."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlmm.config.options import CONF_DIR, group_options

README = Path(__file__).parent.parent / "README.md"


def table_rows() -> dict[str, str]:
    """{group: its row's options cell} of the README's "Config groups" table."""
    rows = {}
    for line in README.read_text().splitlines():
        match = re.match(r"\| `([a-z_/]+)` \| (.*?) \|", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


# Groups whose options the README does not list one by one: a generated table elsewhere lists them (a new option is
# its class and its YAML, nothing else to edit by hand).
GENERATED_ELSEWHERE = {"correction": "docs/corrections.md", "algo": "docs/algorithms.md",
                       "quantization": "docs/precision.md"}


@pytest.mark.parametrize("group", sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir()
                                         and p.name not in ("hydra", "experiment")))
def test_the_readme_table_lists_every_option_of_every_group(group):
    rows = table_rows()
    assert group in rows, f"README's config table has no row for `{group}`"
    if group in GENERATED_ELSEWHERE:
        assert GENERATED_ELSEWHERE[group] in rows[group], f"README's `{group}` row does not point to its table"
        return
    listed = set(re.findall(r"`([A-Za-z0-9_]+)`", rows[group]))
    missing = sorted(set(group_options(group)) - listed)
    assert not missing, f"README's `{group}` row lacks {missing}"


@pytest.mark.parametrize("script,doc", [("corrections_table", "docs/corrections.md"),
                                        ("algorithms_table", "docs/algorithms.md"),
                                        ("quantization_table", "docs/precision.md")])
def test_each_generated_table_is_what_the_classes_and_yamls_say(script, doc):
    """docs/corrections.md's methods table and reference entries, docs/algorithms.md's table of algorithms and
    docs/precision.md's of quantization modes are written by their scripts from every option's YAML (and its
    class): stale (a new option, a changed docstring or value), this fails until it is written again."""
    import importlib
    import sys

    sys.path.insert(0, str(README.parent / "scripts"))
    module = importlib.import_module(script)
    assert module.written() == module.generated(), \
        f"{doc} is stale: run .venv/bin/python scripts/{script}.py --write"
