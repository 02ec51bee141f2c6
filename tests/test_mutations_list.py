"""benchmarks/mutations.py's planted bugs stay valid as the code changes: each edit applies exactly
once, each guarding test exists, and a mutation is planted only in the copy it is given. (The
mutation run itself is long; docs/testing.md says how to run it.)"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mutations():
    spec = importlib.util.spec_from_file_location("ultratron_mutations_script", ROOT / "benchmarks" / "mutations.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up while the class is built)
    spec.loader.exec_module(module)
    return module


def test_every_mutation_applies_exactly_once_and_its_tests_exist(mutations):
    assert mutations.check(ROOT) == []


def test_a_mutation_edits_the_copy_only(mutations, tmp_path):
    mutation = mutations.BY_ID["accum-loss-scale"]
    original = (ROOT / mutation.path).read_text(encoding="utf-8")
    (tmp_path / mutation.path).parent.mkdir(parents=True)
    shutil.copy(ROOT / mutation.path, tmp_path / mutation.path)
    mutations.apply(mutation, tmp_path)
    planted = (tmp_path / mutation.path).read_text(encoding="utf-8")
    assert planted == original.replace(mutation.old, mutation.new) and planted != original
    assert (ROOT / mutation.path).read_text(encoding="utf-8") == original
    with pytest.raises(mutations.Stale, match="occurs 0 times"):  # the old string is gone: stale, not silent
        mutations.apply(mutation, tmp_path)
