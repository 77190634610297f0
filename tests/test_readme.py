"""The README's config table names every option of every group it lists (its `algo` row once listed two of
five algorithms): a new option YAML fails here until the table shows it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlmm.config import CONF_DIR, group_options

README = Path(__file__).parent.parent / "README.md"


def table_rows() -> dict[str, str]:
    """{group: its row's options cell} of the README's "Config groups" table."""
    rows = {}
    for line in README.read_text().splitlines():
        match = re.match(r"\| `([a-z_/]+)` \| (.*?) \|", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


@pytest.mark.parametrize("group", sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir()
                                         and p.name not in ("hydra", "experiment")))
def test_the_readme_table_lists_every_option_of_every_group(group):
    rows = table_rows()
    assert group in rows, f"README's config table has no row for `{group}`"
    listed = set(re.findall(r"`([A-Za-z0-9_]+)`", rows[group]))
    missing = sorted(set(group_options(group)) - listed)
    assert not missing, f"README's `{group}` row lacks {missing}"
