"""Every layout trains exactly like one process on the same global batch.

fp32: losses within 1e-5 relative and gradient norms within 1e-4 of the one-process run, step by
step for five steps. bf16: within bf16 noise — losses within 1e-2 relative, gradient norms within
5e-2 relative. (bf16 keeps 8 mantissa bits, a relative step of 2^-8 ≈ 4e-3 per rounding; FSDP's
MixedPrecisionPolicy also rounds the weights themselves to bf16 where autocast rounds only the
matmul inputs, and the reduction order differs, so differences of a few 1e-3 are expected.)
"""

from __future__ import annotations

import pytest
from dist_common import STEPS, dist_base_fixture, launch, records, references_fixture  # noqa: F401 (fixtures)

LAYOUTS_2 = {
    "dp2-zero0": ["--parallel.dp", "2", "--parallel.zero", "0"],
    "dp2-zero1": ["--parallel.dp", "2", "--parallel.zero", "1"],
    "dp2-zero2": ["--parallel.dp", "2", "--parallel.zero", "2"],
    "dp2-zero3": ["--parallel.dp", "2", "--parallel.zero", "3"],
    "tp2": ["--parallel.tp", "2"],
    "tp2-sp": ["--parallel.tp", "2", "--parallel.sp", "true"],
}
LAYOUTS_4 = {
    "dp2xtp2-sp-zero3": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.sp", "true", "--parallel.zero", "3"],
    "hsdp2x2": ["--parallel.dp", "4", "--parallel.dp_replicate", "2", "--parallel.zero", "3"],
}
PRECISIONS = ("fp32", "bf16")
TOLERANCE = {"fp32": (1e-5, 1e-4, False), "bf16": (1e-2, 5e-2, True)}  # loss rel, norm, norm relative?


def _run_all(world, layouts, dist_base, root) -> dict:
    runs, dirs = [], {}
    for name, args in layouts.items():
        for precision in PRECISIONS:
            run_dir = root / f"{name}-{precision}"
            dirs[(name, precision)] = run_dir
            runs.append(dist_base + args + ["--training.precision", precision, "--run.dir", str(run_dir)])
    launch(world, runs)
    return {key: records(run_dir) for key, run_dir in dirs.items()}


@pytest.fixture(scope="module")
def two_rank_runs(dist_base, references, tmp_path_factory):
    return _run_all(2, LAYOUTS_2, dist_base, tmp_path_factory.mktemp("two"))


@pytest.fixture(scope="module")
def four_rank_runs(dist_base, references, tmp_path_factory):
    return _run_all(4, LAYOUTS_4, dist_base, tmp_path_factory.mktemp("four"))


def _assert_matches(got: list[dict], expected: list[dict], precision: str, name: str) -> None:
    loss_tol, norm_tol, norm_relative = TOLERANCE[precision]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), f"{name}: each step logged once, by rank 0"
    for mine, ref in zip(got, expected, strict=True):
        assert abs(mine["loss"] - ref["loss"]) <= loss_tol * abs(ref["loss"]), (name, precision, mine, ref)
        bound = norm_tol * (abs(ref["grad_norm"]) if norm_relative else 1.0)
        assert abs(mine["grad_norm"] - ref["grad_norm"]) <= bound, (name, precision, mine, ref)
    # the runs learn, so agreement is not the trivial kind
    assert expected[-1]["loss"] < expected[0]["loss"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_two_rank_layouts_equal_one_process(two_rank_runs, references, name, precision):
    _assert_matches(two_rank_runs[(name, precision)], references[precision], precision, name)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_four_rank_layouts_equal_one_process(four_rank_runs, references, name, precision):
    _assert_matches(four_rank_runs[(name, precision)], references[precision], precision, name)
