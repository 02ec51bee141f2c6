"""How fast a matmul and causal attention run by shape: the data behind the planner's matmul
efficiency (`planning/compute.py`).

  python benchmarks/matmul_shapes.py [--out FILE.json] [--quick] [--models] [--fp8]

Times bf16 (fp32 on a CPU) `x @ w` for (M tokens) × (K in) × (N out) over a grid of the per-rank
shapes a layout makes (M: micro-batch tokens; K, N: the width and FFN split by tp), and causal
attention forward + backward (`scaled_dot_product_attention`, head dim 128) by sequence length.
Prints TFLOP/s and the fraction of the best large matmul; writes them as JSON with the device name.
Attention FLOPs are counted as the planner counts them (12·s·h per token per layer for training,
the whole s×s square, as Megatron-LM and PaLM's MFU do), so its "efficiency" is the one the
planner's compute term needs, though a causal kernel does half that work.
--models also times ultratron's Llama forward + backward (bf16 weights, one GPU, no optimizer)
for the 8B and for one tp=8 rank of the 70B and the 8B, emulated by their per-rank shapes (heads,
kv heads, FFN and vocabulary divided by 8), and prints the planner's prediction beside each
(products, attention and the elementwise kernels).
--fp8 also times the products in fp8 as torchao's tensorwise Float8Linear runs them, beside the bf16
ones: the rate `plan estimate --precision fp8` assumes (twice bf16's) and nobody here has measured.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F


def _timed(fn, device: str, repeat: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def product(device: str, dtype, m: int, k: int, n: int):
    """A function computing one (m × k) @ (k × n) product as training runs it. "fp8": torchao's
    tensorwise Float8Linear kernel, `torch._scaled_mm` over e4m3 operands (the second one
    column-major, as the kernel requires) with one scale each and a bf16 output."""
    if dtype == "fp8":
        x = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        w = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(x, w, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(k, n, device=device, dtype=dtype)
    return lambda: x @ w


def matmuls(device: str, dtype, ms, ks, ns, repeat: int) -> list[dict]:
    rows = []
    for m in ms:
        for k in ks:
            for n in ns:
                seconds = _timed(product(device, dtype, m, k, n), device, repeat)
                rows.append({"m": m, "k": k, "n": n, "seconds": seconds, "flops_per_s": 2 * m * k * n / seconds})
    return rows


def attention(device: str, dtype, seqs, heads: int, head_dim: int, repeat: int) -> list[dict]:
    rows = []
    for s in seqs:
        q, k, v = (torch.randn(1, heads, s, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))

        def step(q=q, k=k, v=v):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))

        seconds = _timed(step, device, repeat)
        model_flops = 12 * s * heads * head_dim * s  # 12·s·h per token × s tokens (training, full square)
        rows.append({"seq": s, "heads": heads, "head_dim": head_dim, "seconds": seconds,
                     "flops_per_s": model_flops / seconds})
    return rows


MODELS = (  # name, layers, dim, heads, kv heads, ffn, seq, micro-batch, vocab, head dim
    ("llama3-8b", 32, 4096, 32, 8, 14336, 8192, 1, 128256, 0),
    ("llama3-8b seq 2048 mbs 4", 32, 4096, 32, 8, 14336, 2048, 4, 128256, 0),
    ("llama3-70b tp8 rank, 10 layers, whole vocab", 10, 8192, 8, 1, 3584, 8192, 1, 128256, 128),
    ("llama3-70b tp8 rank, 10 layers", 10, 8192, 8, 1, 3584, 8192, 1, 16032, 128),
    ("llama3-8b tp8 rank", 32, 4096, 4, 1, 1792, 8192, 1, 16032, 128),
)


def models(device: str, repeat: int) -> list[dict]:
    from ultratron.models.llama.model import Llama, LlamaArgs
    from ultratron.models.presets import ModelShape
    from ultratron.planning.compute import one_gpu_step_seconds
    from ultratron.planning.hardware import find_accelerator

    acc = find_accelerator(torch.cuda.get_device_name()) if device == "cuda" else None
    rows = []
    for name, layers, dim, heads, kv, ffn, seq, mbs, vocab, head_dim in MODELS:
        with torch.device(device):
            model = Llama(LlamaArgs(n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn,
                                    vocab_size=vocab, max_seq_len=seq, tie_embeddings=False,
                                    head_dim=head_dim)).to(torch.bfloat16)
        tokens = torch.randint(0, vocab, (mbs, seq), device=device)

        def step(model=model, tokens=tokens):
            logits = model(tokens)
            F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()

        seconds = _timed(step, device, repeat)
        shape = ModelShape(n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn, vocab_size=vocab,
                           tie_embeddings=False, rope_theta=5e5, max_seq_len=seq, head_dim=head_dim)
        row = {"name": name, "layers": layers, "dim": dim, "heads": heads, "kv": kv, "ffn": ffn, "seq": seq,
               "mbs": mbs, "vocab": vocab, "head_dim": head_dim, "seconds": seconds,
               "tokens_per_s": mbs * seq / seconds}
        if acc is not None:  # as the planner prices a step (planning.compute.one_gpu_step_seconds)
            row["predicted_tokens_per_s"] = mbs * seq / one_gpu_step_seconds(shape, mbs, seq, acc)
        rows.append(row)
        print(row, flush=True)
        del model
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the measurements as JSON")
    parser.add_argument("--quick", action="store_true", help="a small grid (a CPU)")
    parser.add_argument("--models", action="store_true", help="also whole models forward + backward (a GPU)")
    parser.add_argument("--fp8", action="store_true", help="also the products in fp8 (torch._scaled_mm, tensorwise "
                                                           "scales): the rate the planner's fp8 estimate lacks")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.quick or device == "cpu":
        ms, ks, seqs, repeat = (64, 256, 1024), (128, 512, 1024), (256, 1024), 3
    else:
        ms, ks, seqs, repeat = (256, 1024, 2048, 4096, 8192, 16384), (256, 512, 1024, 2048, 4096, 8192, 16384), \
            (512, 1024, 2048, 4096, 8192, 16384, 32768), 10
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    mm = matmuls(device, dtype, ms, ks, ks, repeat)
    best = max(r["flops_per_s"] for r in mm)
    print(f"{name} {dtype}: best matmul {best / 1e12:.1f} TFLOP/s")
    print(f"{'M':>6} {'K':>6} {'N':>6} {'TFLOP/s':>9} {'of best':>8}")
    for r in mm:
        print(f"{r['m']:>6} {r['k']:>6} {r['n']:>6} {r['flops_per_s'] / 1e12:>9.1f} {r['flops_per_s'] / best:>8.2f}")
    att = attention(device, dtype, seqs, 32 if device == "cuda" else 4, 128, repeat)
    print(f"{'seq':>6} {'model TFLOP/s':>14} {'of best matmul':>15}")
    for r in att:
        print(f"{r['seq']:>6} {r['flops_per_s'] / 1e12:>14.1f} {r['flops_per_s'] / best:>15.2f}")
    fp8 = matmuls(device, "fp8", ms, ks, ks, repeat) if args.fp8 else []
    if fp8:
        print(f"fp8 (torch._scaled_mm, bf16 output): best {max(r['flops_per_s'] for r in fp8) / 1e12:.1f} TFLOP/s")
        print(f"{'M':>6} {'K':>6} {'N':>6} {'TFLOP/s':>9} {'÷ bf16':>7}")
        for r, b in zip(fp8, mm, strict=True):
            print(f"{r['m']:>6} {r['k']:>6} {r['n']:>6} {r['flops_per_s'] / 1e12:>9.1f} "
                  f"{r['flops_per_s'] / b['flops_per_s']:>7.2f}")
    whole = models(device, repeat) if args.models else []
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"device": name, "dtype": str(dtype), "matmul": mm, "matmul_fp8": fp8, "attention": att,
                       "models": whole}, f, indent=1)


if __name__ == "__main__":
    main()
