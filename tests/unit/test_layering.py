"""The layering rule of docs/layout.md and what src/ and scripts/ must not hold.

Rooms, lowest first: kernels <- runtime <- parallel <- engine. Every module of a room may import the rooms below it
and never one above: read from the source with `ast`, so an import inside a function counts as much as a top-level
one, and so does a module named by a literal string to `importlib.import_module` / `__import__`. src/ holds no
test-only switch (the tests plant their bugs themselves: tests/multiprocess/workers/train_with_hooks.py), and
scripts/ import nothing from tests/ (scripts travel to the GPU box and run from an installed tripod)."""
from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from tests.helpers.common import REPO_ROOT

PACKAGE = REPO_ROOT / "src" / "tripod"
ROOMS = ("kernels", "runtime", "parallel", "engine")  # each may import only the rooms before it
TEST_SWITCHES = re.compile(r"TRIPOD_PLANT|TRIPOD_TEST_")


def _python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import in `path` (a module of `package`, for relative imports), at any depth:
    `import a.b`, `from a import b` (as a.b too, b may be a module), relative imports resolved, and string literals
    passed to importlib.import_module / __import__."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return found


def higher_room_imports(room: str, root: Path = PACKAGE) -> list[str]:
    """'path:line imports module' for every import of a room above `room` by a module of `room`."""
    above = ROOMS[ROOMS.index(room) + 1:]
    bad: dict[tuple[Path, int], str] = {}  # the first offending module of each import line
    for path in _python_files(root / room):
        package = ".".join(path.relative_to(root.parent).parts[:-1])
        for line, module in imported_modules(path, package):
            if any(module == f"tripod.{r}" or module.startswith(f"tripod.{r}.") for r in above):
                bad.setdefault((path, line), module)
    return [f"{_shown(path)}:{line} imports {module}" for (path, line), module in bad.items()]


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


@pytest.mark.parametrize("room", ROOMS[:-1])
def test_a_room_imports_no_room_above_it(room):
    assert higher_room_imports(room) == [], f"{room} must import only {ROOMS[:ROOMS.index(room)]} (docs/layout.md)"


def test_the_layering_check_sees_lazy_relative_and_string_imports(tmp_path):
    room = tmp_path / "tripod" / "parallel"
    room.mkdir(parents=True)
    (room / "__init__.py").write_text("")
    (room / "ok.py").write_text("import torch\nfrom tripod.runtime.device import current_device\n"
                                "from tripod.kernels import gae\nfrom . import ok\n")
    (room / "lazy.py").write_text("def f():\n    from tripod.engine.workers.batch import build_ppo_batch\n")
    (room / "up.py").write_text("from .. import engine\n")
    (room / "named.py").write_text("import importlib\nm = importlib.import_module('tripod.engine.trainer')\n")
    (room / "whole.py").write_text("import tripod.engine.cli as cli\n")
    bad = higher_room_imports("parallel", tmp_path / "tripod")
    assert sorted(b.split(os.sep)[-1] for b in bad) == [
        "lazy.py:2 imports tripod.engine.workers.batch", "named.py:2 imports tripod.engine.trainer",
        "up.py:1 imports tripod.engine", "whole.py:1 imports tripod.engine.cli"], bad


def test_src_holds_no_test_only_switch():
    hits = [f"{_shown(p)}:{i}: {line.strip()}" for p in _python_files(PACKAGE)
            for i, line in enumerate(p.read_text().splitlines(), 1) if TEST_SWITCHES.search(line)]
    assert hits == [], "plant bugs from tests/ (tests/multiprocess/workers/train_with_hooks.py), not through src/"


def test_scripts_import_nothing_from_tests():
    scripts = REPO_ROOT / "scripts"
    hits = sorted({f"{_shown(p)}:{line}" for p in _python_files(scripts)
                   for line, module in imported_modules(p, "scripts") if module == "tests" or module.startswith("tests.")})
    assert hits == [], "scripts/ run without the test suite (the GPU check installs tripod from a wheel): " \
                       "move what they need into src/tripod"
