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
# Calls that write or read checkpoint state. Only checkpoint/manager.py may make them.
STATE_IO = {("torch", "save"), ("torch", "load"), ("dcp", "save"), ("dcp", "load"), ("dcp", "async_save")}


def test_import_contracts_hold():
    """Layers, independent applications, no cycles (function-level imports included), no torch in
    the planner or the config: the contracts in pyproject.toml [tool.importlinter]."""
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def _state_io_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        func = getattr(node, "func", None)
        if isinstance(node, ast.Call) and isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if (func.value.id, func.attr) in STATE_IO:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.func.value.id}.{node.func.attr}")
    return found


def test_one_save_path_and_one_load_path():
    calls = [c for path in sorted(PACKAGE.rglob("*.py")) for c in _state_io_calls(path)]
    assert calls and all(c.startswith("checkpoint/manager.py:") for c in calls), calls
    source = (PACKAGE / "checkpoint" / "manager.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    owners = {fn.name for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
              for node in ast.walk(fn) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and isinstance(node.func.value, ast.Name) and (node.func.value.id, node.func.attr) in STATE_IO}
    assert owners == {"write_checkpoint", "read_checkpoint"}


def test_no_module_is_longer_than_the_limit():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, long


def test_the_training_loop_fits_on_one_screen():
    lines = inspect.getsource(Trainer.fit).splitlines()
    assert len(lines) <= 40, len(lines)
