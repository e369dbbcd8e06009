"""Dependencies point one way: the step contract (photon.core) imports neither the engine nor the
runner, and the runner side (photon.worker) never imports the engine (the scheduler, requests,
the pipeline) nor the engine-side grammar state. Checked on the source, type-only imports
included, so a layer cannot lean on another's types either."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import photon

ROOT = Path(photon.__file__).parent
FORBIDDEN = {
    "core": ("photon.engine", "photon.worker", "photon.structured.manager",
             "photon.structured.step", "photon.server"),
    "worker": ("photon.engine", "photon.structured.manager", "photon.structured.step",
               "photon.structured.rows", "photon.server"),
}


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_import_the_layers_above_it(package: str) -> None:
    files = sorted((ROOT / package).glob("*.py"))
    assert files
    bad = [f"{f.name}: {name}" for f in files for name in _imports(f)
           if name.startswith(FORBIDDEN[package])]
    assert bad == []
