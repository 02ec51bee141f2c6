"""The architecture the docs describe (docs/architecture.md), checked: one-way imports without
cycles, one owner of checkpoint files, short modules, a training loop that reads on one screen."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import ultratron
from ultratron.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(ultratron.__file__).parent
MAX_LINES = 450
# Calls that write or read checkpoint state. Only checkpoint/manager.py may make them: saves in
# CheckpointWriter.write, loads in read_checkpoint.
STATE_IO = {("torch", "save"), ("torch", "load"), ("dcp", "save"), ("dcp", "load"), ("dcp", "async_save")}


def test_import_contracts_hold():
    """Layers, independent applications, no cycles (function-level imports included), no torch in
    the planner or the config: the contracts in pyproject.toml [tool.importlinter]."""
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def _is_state_io(node: ast.AST) -> bool:
    func = getattr(node, "func", None)
    return (isinstance(node, ast.Call) and isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and (func.value.id, func.attr) in STATE_IO)


def _state_io_calls(path: Path) -> list[str]:
    return [f"{path.relative_to(PACKAGE)}:{node.lineno} {node.func.value.id}.{node.func.attr}"
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if _is_state_io(node)]


def _owners(body: list[ast.stmt], prefix: str = ""):
    """The functions and methods (by qualified name) that make state I/O calls."""
    for node in body:
        if isinstance(node, ast.ClassDef):
            yield from _owners(node.body, f"{node.name}.")
        elif isinstance(node, ast.FunctionDef) and any(_is_state_io(n) for n in ast.walk(node)):
            yield prefix + node.name


def test_one_save_path_and_one_load_path():
    calls = [c for path in sorted(PACKAGE.rglob("*.py")) for c in _state_io_calls(path)]
    assert calls and all(c.startswith("checkpoint/manager.py:") for c in calls), calls
    tree = ast.parse((PACKAGE / "checkpoint" / "manager.py").read_text(encoding="utf-8"))
    assert set(_owners(tree.body)) == {"CheckpointWriter.write", "read_checkpoint"}


def test_no_module_is_longer_than_the_limit():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, long


def test_the_training_loop_fits_on_one_screen():
    lines = inspect.getsource(Trainer.fit).splitlines()
    assert len(lines) <= 40, len(lines)
