"""The package tree is the pipeline's stages, and imports only run down it (issue 51).

Each layer may import its own and the layers below it, never one above: the machine (runtime) under the policy's
numbers (policy) under the options (config), the models and tasks, the measures (mismatch), the parts a run is built
from (samplers, trainers, corrections, algos), the run itself, the tools that read runs (probe, table) and, at the
top, what turns a command line into a job (launch, cli.py). Import cycles are checked by
../shared/tools/import_cycles.py; this checks the direction, including imports inside functions.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rlmm"
LAYERS = (
    ("runtime",),
    ("policy",),
    ("config",),
    ("models", "tasks", "conversation"),
    ("mismatch",),
    ("samplers", "trainers", "corrections", "algos"),
    ("run",),
    ("probe", "table"),
    ("launch",),
    ("cli",),
)
LAYER_OF = {part: index for index, parts in enumerate(LAYERS) for part in parts}


def part_of(module: str) -> str:
    """`rlmm.run.step` -> `run`, `rlmm.cli` -> `cli`."""
    return module.split(".")[1]


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts == ("rlmm", "__init__"):
            continue
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def rlmm_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every rlmm import in the file, at module level or inside a function."""
    imported = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("rlmm."):
            imported.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.module == "rlmm":
            imported.extend((node.lineno, f"rlmm.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.extend((node.lineno, alias.name) for alias in node.names if alias.name.startswith("rlmm."))
    return imported


def test_every_module_belongs_to_one_layer():
    unplaced = sorted({part_of(name) for name in modules()} - LAYER_OF.keys())
    assert not unplaced, f"rlmm/{unplaced[0]}: in no layer of {LAYERS} (place it in test_layers.LAYERS)"


@pytest.mark.parametrize("layer", [parts[0] for parts in LAYERS])
def test_imports_run_only_down_the_layers(layer):
    upward = []
    for name, path in sorted(modules().items()):
        if LAYER_OF.get(part_of(name)) != LAYER_OF[layer]:
            continue
        for line, imported in rlmm_imports(path):
            if LAYER_OF[part_of(imported)] > LAYER_OF[layer]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported}")
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from rlmm.run.train import main\n    import rlmm.launch.apps\n")
    assert rlmm_imports(module) == [(4, "rlmm.run.train"), (5, "rlmm.launch.apps")]
