"""`benchmarks/matmul_shapes.py` times the products training runs: in fp8, torchao's tensorwise kernel."""

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _benchmark():
    spec = importlib.util.spec_from_file_location("ultratron_matmul_shapes", ROOT / "benchmarks" / "matmul_shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fp8_product_is_the_e4m3_operands_product_in_bf16():
    bench = _benchmark()
    torch.manual_seed(0)
    fp8 = bench.product("cpu", "fp8", 32, 64, 48)
    out = fp8()
    assert out.shape == (32, 48) and out.dtype == torch.bfloat16
    # the same seed gives the same operands: their e4m3 values multiplied exactly, then rounded to bf16
    torch.manual_seed(0)
    x = torch.randn(32, 64).to(torch.float8_e4m3fn).float()
    w = torch.randn(48, 64).to(torch.float8_e4m3fn).float().t()
    exact = x @ w
    # bf16 keeps 8 significant bits: each output within half a unit in its last place of the exact sum
    assert torch.allclose(out.float(), exact, rtol=2**-8, atol=0)
    rows = bench.matmuls("cpu", "fp8", (32,), (64,), (48,), 1)
    assert rows[0]["flops_per_s"] == pytest.approx(2 * 32 * 64 * 48 / rows[0]["seconds"])
