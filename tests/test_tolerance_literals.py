"""Every literal tolerance left in tests/ is listed here with the reason it is not a comparison of
two training runs (those take theirs from tests/tolerances.py, the one derivation). A new literal
in a test fails this test until it is moved there or given a reason below.

`python tests/test_tolerance_literals.py` prints the list: file:line, the code, and why.

A literal is a float in (0, 1) given as a comparison's right side (`gap <= 1e-5`, `< 0.02 * x`) or
as `atol`, `rtol`, `rel` or `abs`; integers, `== 0` and `torch.equal` are exact and not listed.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent
KEYWORDS = {"atol", "rtol", "rel", "abs"}

FORMULA = "a number against a formula or a published figure, in Python floats: no kernel rounds it"
PLANNER = ("a measured count of bytes or FLOPs (exact integers) against the planner's model: the tolerance "
           "bounds the model's error, derived in the test's docstring; no kernel's rounding enters")
ONE_FORWARD = ("one forward (or one block's backward) computed two ways in one process, not a training run: "
               "fp32 rounding of sums of at most a few hundred terms (n·2^-24), derived in the test's docstring")
SAME_FLOAT = "the same float read back from two records: equal up to the printing of a double"
BEHAVIOUR = "a threshold on what a run does (it learned, a share is small), not agreement of two computations"
DATA = "a probability or share in the data generators and their bounds: no floating-point arithmetic compared"

# whole files whose every literal is of one kind (none of them compares two training runs)
FILES = {
    "planning/": PLANNER + "; or " + FORMULA,
    "bench/": PLANNER + "; or " + FORMULA,
    "data/test_curation_": DATA,
    "data/multilingual_corpus.py": DATA,
    "distributed/test_dist_activation_memory.py": PLANNER,
    "distributed/test_dist_memory.py": PLANNER,
    "distributed/test_dist_pipeline_memory.py": PLANNER,
    "distributed/test_dist_simulate.py": PLANNER,
    "test_simulate.py": PLANNER,
    "test_simulate_scale.py": PLANNER,
    "distributed/test_dist_context_parallel.py": ONE_FORWARD,
    "test_document_masking.py": ONE_FORWARD,
    "evaluation/test_export_hf.py": ONE_FORWARD + " (ours and transformers')",
    "evaluation/test_export_hf_moe.py": ONE_FORWARD + " (ours and transformers')",
    "evaluation/test_serve_kv_cache.py": ONE_FORWARD + " (with the KV cache and recomputed)",
    "test_hf_import.py": ONE_FORWARD + " (transformers' and the imported run's first step, before any update)",
    "test_tracking.py": SAME_FLOAT,
    "test_finetune_chat.py": BEHAVIOUR,
}
# single lines of files that also compare training runs (through tests/tolerances.py), by a piece of their code
LINES = {
    "test_train_run.py": {
        'steps[-1]["loss"] < steps[0]["loss"] - 0.5': BEHAVIOUR,
        'runs["bf16"][-1]["loss"] < runs["bf16"][0]["loss"] - 0.5': BEHAVIOUR,
        "with_z2 < 0.8 * plain_z2": BEHAVIOUR,
        "pytest.approx(limit, rel=1e-4)": "one gradient's norm after clipping against the limit it was scaled to: "
                                          "the float32 sum of squares over 4M-element tensors (√n·2^-24)",
        "before * (limit / norm), rtol=1e-4": "the clip's scaling of each gradient, one multiplication per element",
    },
    "test_fp8.py": {"final_fp8 < 0.85 * fp8[1]": BEHAVIOUR},
    "test_batch_ramp.py": {"target + 1e-9": FORMULA, "rel=1e-12": SAME_FLOAT},
    "data/test_chat_data.py": {"rel=1e-12": SAME_FLOAT},
    "data/test_mixture.py": {"< 0.01": "a share of sampled tokens against its weight: a sampling bound, no rounding",
                             "0.4 < last": "a share of sampled tokens against its schedule: a sampling bound"},
    "test_compile.py": {"allclose": ONE_FORWARD + " (one compiled block against eager)"},
    "test_chunked_loss.py": {'"peak_ratio"': PLANNER + " (simulate's measured peak against plan memory's)",
                             '"flops_ratio"': PLANNER + " (simulate's counted FLOPs against the planner's)",
                             "approx(planned, rel=0.05)": PLANNER + " (the peak's fall, measured and planned)"},
    "test_offload.py": {"approx(saved, rel=0.05)": "bytes moved to the host against the bytes the blocks save, "
                                                   "counted by two meters (storages against tensors): no rounding",
                        '"peak_ratio"': PLANNER + " (simulate's measured peak against plan memory's)"},
    "distributed/test_dist_offload.py": {"approx(planned, rel=0.10)": PLANNER + " (bytes moved under tp against the "
                                                                     "planner's per-op tp activation model)"},
    "test_lora.py": {"1e-5 * want.abs().max()": ONE_FORWARD + " (merged weights against adapters applied)"},
    "test_model.py": {"atol=1e-": ONE_FORWARD + " (the same model on two inputs or with a cap far away)",
                      "rel=0.05": FORMULA + " (the initialisation's standard deviation, sampled)"},
    "test_moe.py": {"< 0.5 * before": BEHAVIOUR, "- 1) < 0.02": FORMULA,
                    "rtol=1e-5, atol=1e-6": ONE_FORWARD + " (the layer against its definition, 16 experts' sums)"},
    "test_init.py": {"whole.abs().max() <= 0.5": "the uniform rule's draws against its bound ±0.5 and a spread that "
                                                 "shows they were drawn: a property of the draw, no rounding compared"},
    "test_schedule.py": {"atol=1e-7": "one AdamW step against its formula written out, in fp32, on one tensor"},
    "test_resilience.py": {"0.02 * clean.final_val_loss": "a run that skipped its faulty steps against a clean "
                                                          "one: other data, so a learning bound, not rounding"},
    "evaluation/test_eval_builtin.py": {"- 0.5": BEHAVIOUR, "abs=0.3": FORMULA + " (an untrained model's loss, "
                                                                                 "log 512)"},
    "evaluation/test_eval_endpoint.py": {"1e-4": "one evaluation through two backends (the server batches and pads "
                                                 "prompts another way): " + ONE_FORWARD},
    "evaluation/test_serve_openai.py": {"1e-": "a log-probability the server returns against the model's, "
                                              + ONE_FORWARD},
    "distributed/test_dist_equivalence.py": {"1e-6 * got[\"whole\"]": "the clipped norm against every whole "
                                             "gradient's norm in float64 on the same rank: one sum, derived in "
                                             "the test's docstring"},
}


def _literal(node) -> bool:
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, float) and 0 < node.value < 1


def _holds_literal(node) -> bool:
    if isinstance(node, ast.BinOp):
        return _holds_literal(node.left) or _holds_literal(node.right)
    return _literal(node)


def literals() -> list[tuple[str, int, str]]:
    """(path relative to tests/, line, the line's code) of every literal tolerance in tests/."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.name in {Path(__file__).name, "tolerances.py"}:
            continue
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.keyword) and node.arg in KEYWORDS and _literal(node.value):
                line = node.value.lineno
            elif isinstance(node, ast.Compare) and all(isinstance(op, ast.Lt | ast.LtE) for op in node.ops) \
                    and _holds_literal(node.comparators[-1]):
                line = node.comparators[-1].lineno
            else:
                continue
            found.append((path.relative_to(TESTS).as_posix(), line, lines[line - 1].strip()))
    return sorted(set(found))


def reason(path: str, code: str) -> str | None:
    for piece, why in LINES.get(path, {}).items():
        if piece in code:
            return why
    return next((why for prefix, why in FILES.items() if path.startswith(prefix)), None)


def test_every_literal_tolerance_has_a_reason():
    unexplained = [f"{path}:{line}: {code}" for path, line, code in literals() if reason(path, code) is None]
    assert not unexplained, ("literal tolerances without a reason: take the tolerance from tests/tolerances.py "
                             "or say in tests/test_tolerance_literals.py why it is not two runs' agreement:\n"
                             + "\n".join(unexplained))


def test_files_that_compare_training_runs_have_no_blanket_reason():
    """A file that takes tolerances from tests/tolerances.py compares training runs somewhere, so its
    other literals are explained line by line, never by a reason for the whole file."""
    comparing = {path.relative_to(TESTS).as_posix() for path in TESTS.rglob("test_*.py")
                 if "tolerances import" in path.read_text()}
    assert {"test_train_resume.py", "distributed/test_dist_cp_ep.py", "test_compile.py"} <= comparing
    blanket = [path for path in comparing if any(path.startswith(prefix) for prefix in FILES)]
    assert not blanket, blanket


def test_the_scan_finds_a_planted_literal(tmp_path, monkeypatch):
    """The scan itself can fail: an atol and a `<= 1e-6` in a new file are found and unexplained."""
    planted = TESTS / "distributed" / "test_zz_planted_literal.py"
    monkeypatch.setattr(Path, "rglob", lambda self, pattern: iter([planted]))
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (
        "def test_x(a, b, gap):\n    assert a.allclose(b, atol=1e-6)\n    assert gap <= 1e-6 * b\n"))
    found = literals()
    assert [(path, line) for path, line, _ in found] == [("distributed/test_zz_planted_literal.py", 2),
                                                          ("distributed/test_zz_planted_literal.py", 3)]
    assert all(reason(path, code) is None for path, _, code in found)


if __name__ == "__main__":
    for path, line, code in literals():
        print(f"tests/{path}:{line}: {code}\n    {reason(path, code) or 'NO REASON: move it to tests/tolerances.py'}")
