# The README's two commands: `make quickstart` (the main job on the built-in corpus) and
# `make test`. Both create .venv on first use. torch is pinned here to the CPU wheel that CI
# installs from local disk; the package itself accepts a range (see pyproject.toml).
PYTHON ?= python3
VENV := .venv
TORCH_PIN ?= torch==2.13.0
# test files run on this many pytest-xdist workers, a file to a worker (its module fixtures run once);
# much of the suite waits on process start-up and gloo, so 2 workers suit even a 2-core machine
TEST_WORKERS ?= 2

.PHONY: setup quickstart test test-other-isa lint gpu-check clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet "$(TORCH_PIN)"
	$(VENV)/bin/pip install --quiet -e ".[test]"
	touch $@

quickstart: setup
	$(VENV)/bin/ultratron quickstart

test: setup
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

# The tests that compare computations whose rounding depends on the CPU's kernels, again with the
# kernels on another instruction set (docs/testing.md): ATen's AVX2 kernels, oneDNN without AMX or
# AVX-512 bf16, MKL's AVX path (no FMA). A tolerance fitted to one CPU's rounding fails here.
# Inductor keeps its own cache for this pass: its cache key misses ATEN_CPU_CAPABILITY, and kernels
# compiled for AVX-512 by the first pass, loaded under AVX2, gave NaN losses (torch 2.13).
OTHER_ISA := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX512_CORE MKL_CBWR=AVX \
	TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/$(VENV)/inductor-other-isa
ISA_TESTS ?= tests/distributed/test_dist_equivalence.py tests/distributed/test_dist_combinations.py \
	tests/distributed/test_dist_offload.py \
	tests/distributed/test_dist_cp_ep.py tests/distributed/test_dist_pipeline.py tests/distributed/test_dist_context_parallel.py \
	 tests/test_grad_accum.py tests/test_train_run.py tests/test_compile.py \
	tests/test_document_masking.py tests/test_moe.py tests/test_cpu_linear.py tests/test_fp8.py tests/test_chunked_loss.py \
	tests/planning/test_plan_measured.py \
	tests/distributed/test_dist_activation_memory.py

test-other-isa: setup
	$(OTHER_ISA) $(VENV)/bin/python -c "import torch; c = torch.backends.cpu.get_cpu_capability(); \
	print('second pass: ATen kernels on', c); assert c in ('AVX2', 'DEFAULT'), c"
	$(OTHER_ISA) $(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=10 $(ISA_TESTS)

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks

# The prepared GPU check (docs/performance.md): on one GPU, every figure beside the planner's in under
# 8 minutes; without a GPU the same rows at a tiny size. GPU_CHECK_ARGS: e.g. --gpu h100-pcie, --only eager
gpu-check: setup
	$(VENV)/bin/python benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
