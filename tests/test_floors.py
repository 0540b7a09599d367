"""The kit's floors: every import in dlrmkit/ points down (docs/development.md draws them).

Parsed from the source, imports inside functions included: a kit module imports only modules of
its own floor or below, never TorchServe (``ts``), a root module (the handler, scripts, bench,
tests) or another module's private name, and the kit's imports have no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KIT = ROOT / "dlrmkit"

# Lowest first. A module may import its own floor and the floors below it.
FLOORS: list[set[str]] = [
    {"errors"},
    {"config"},
    {"cpus", "malloc", "parts", "scale", "hot", "tally"},
    {"model"},
    {"dense", "criteo", "schema", "request", "forms", "protocols", "batch"},
    {"accuracy", "checkpoint", "live", "stream", "worker"},
]
# Never imported by a kit module: TorchServe, and what lives outside the package.
FORBIDDEN = {"ts", "dlrm_handler", "dlrm_factory", "scripts", "bench", "tests", "conftest", "helpers"}


def floor_of(unit: str) -> int:
    for i, names in enumerate(FLOORS):
        if unit in names:
            return i
    raise KeyError(unit)


def unit_of(path: Path, kit: Path = KIT) -> str:
    """dlrmkit/live/tables.py -> 'live'; dlrmkit/batch.py -> 'batch' (a subpackage is one unit)."""
    return path.relative_to(kit).parts[0].removesuffix(".py")


def imports(path: Path, kit: Path = KIT) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every import in ``path``, functions included."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(("dlrmkit", *path.relative_to(kit).parts[:-1]))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((node.lineno, module, [a.name for a in node.names]))
    return found


def violations(kit: Path = KIT) -> list[str]:
    bad = []
    edges: dict[str, set[str]] = {}
    for path in sorted(kit.rglob("*.py")):
        if path.name == "__init__.py" and path.parent == kit:
            continue
        me = unit_of(path, kit)
        where = path.relative_to(kit.parent)
        try:
            mine = floor_of(me)
        except KeyError:
            bad.append(f"{where}: '{me}' is on no floor (add it to FLOORS and docs/development.md)")
            continue
        for line, module, names in imports(path, kit):
            top = module.split(".")[0]
            if top in FORBIDDEN:
                bad.append(f"{where}:{line} imports {module} (no kit module imports TorchServe or a root module)")
                continue
            if top != "dlrmkit":
                continue
            parts = module.split(".")
            if len(parts) == 1:  # from dlrmkit import x, y
                targets = [(n, [n]) for n in names]
            else:
                targets = [(parts[1], names)]
                if any(p.startswith("_") for p in parts[1:]):
                    bad.append(f"{where}:{line} imports private module {module}")
            for unit, wanted in targets:
                private = [n for n in wanted if n.startswith("_") and unit != me]
                if private:
                    bad.append(f"{where}:{line} takes {unit}'s private {', '.join(private)}")
                if unit == me:
                    continue
                try:
                    theirs = floor_of(unit)
                except KeyError:
                    continue  # reported once as its own file
                if theirs > mine:
                    bad.append(f"{where}:{line} imports {unit} (floor {theirs}) from floor {mine}: arrows point down")
                edges.setdefault(me, set()).add(unit)
    bad += [f"import cycle: {' -> '.join(c)}" for c in cycles(edges)]
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            found.append([*path[path.index(node) :], node])
            return
        if node in done:
            return
        for nxt in sorted(edges.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for start in sorted(edges):
        visit(start, [])
    return found


def test_every_kit_import_points_down():
    assert violations() == []


@pytest.mark.parametrize(
    "source, says",
    [
        ("from ts.utils.util import PredictionException\n", "imports ts.utils.util"),
        ("def f():\n    import dlrm_handler\n", "imports dlrm_handler"),
        ("def f():\n    from scripts import tsctl\n", "imports scripts"),
        ("from dlrmkit.batch import collate\n", "imports batch (floor 4) from floor 1"),
        ("from dlrmkit.errors import _hidden\n", "takes errors's private _hidden"),
    ],
)
def test_the_floor_check_catches_an_arrow_up(tmp_path, source, says):
    kit = tmp_path / "dlrmkit"
    kit.mkdir()
    (kit / "config.py").write_text(source)
    found = violations(kit)
    assert any(says in v for v in found), found


def test_the_floor_check_catches_a_cycle(tmp_path):
    kit = tmp_path / "dlrmkit"
    (kit / "live").mkdir(parents=True)
    (kit / "forms.py").write_text("from dlrmkit.batch import collate\n")
    (kit / "batch.py").write_text("def f():\n    from dlrmkit import forms\n")
    assert any(v.startswith("import cycle: batch -> forms -> batch") for v in violations(kit))
