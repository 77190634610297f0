"""scripts/mutants.py breaks the step on purpose by exact source edits; a refactor that moves the code an edit
names leaves the mutant unappliable, and the check it stands for silently stops (three had, after issue 24's
moves). Every edit's text must occur exactly once in its file, and every test it runs must exist."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from mutants import MUTANTS  # noqa: E402


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_every_mutant_still_applies_to_the_code(mutant):
    for path, text, replacement in mutant.edits:
        source = (ROOT / path).read_text()
        assert source.count(text) == 1, f"{mutant.name}: {path} holds its edit's text {source.count(text)} times"
        assert text != replacement
    for test in mutant.tests:
        assert (ROOT / test.split("::")[0]).exists(), f"{mutant.name}: no {test}"
