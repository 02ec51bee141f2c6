"""ultratron's training step against a plain PyTorch GPT training step of the same shape and FLOPs.

  python benchmarks/step_vs_plain.py [--rounds 20] [--warmup 3] [--precisions fp32,bf16] [--compile]
                                     [--plain-compile] [--cpu-linear onednn|aten]

The plain step is written here the straightforward way a user would (nanoGPT's shape and loop):
an `nn.Module` GPT with learned positions, LayerNorm, `F.scaled_dot_product_attention` and a GELU
MLP; `torch.optim.AdamW` with its defaults; `torch.autocast` for bf16; a random batch of the same
token data each step, the loss, backward, `clip_grad_norm_(1.0)`, the update. ultratron runs its
real `Trainer.train_step` (loader, step strategy, global-norm clip, fused AdamW, the record) on a
Llama of the same matmul FLOPs: 6 layers, width 384, 6 heads (no GQA: the same attention FLOPs),
SwiGLU width 1024 (3·384·1024 = 2·384·1536 weights), vocabulary 4096 tied, seq 256, batch 8.

The two steps run interleaved — A B A B ... — in one process, so that load on this shared
machine falls on both alike; the medians and their ratio (ultratron tokens/s ÷ plain tokens/s),
and the median of each pair's own ratio (less moved by load that drifts during the run), are
printed per precision, with the load average. Each precision builds its own pair of
models. The data (the built-in corpus, tokenized to 4096) is prepared once in runs/bench-data.

Measured here (2-core AMD EPYC, torch 2.13 CPU, 20 pairs), ratio of the medians, ultratron ÷ plain
tokens/s: --compile fp32 1.51×, bf16 1.14–1.19× over five runs (median 1.17×); eager fp32 1.40×,
bf16 0.85×; --compile --plain-compile fp32 1.44×, bf16 0.95×. The fp32 gain is training.cpu_linear
= onednn (opt-in in the trainer, the default here: oneDNN's matmul where torch's MKL sgemm runs AVX2
code on this CPU): with torch's kernel (--cpu-linear aten) the compiled fp32 step was 1.01–1.04×
the plain one. A later session on a slower day of the same machine: --compile fp32 1.08–1.12×
(median of five runs 1.115×), bf16 1.135–1.147×; eager fp32 1.02×, bf16 0.92×. A third, after the
weight gradient moved to MKL's sgemm (no copies; 16 pairs): --compile fp32 1.206, 1.185, 1.147×
(median 1.185×), bf16 1.159, 1.124, 1.127× (median 1.127×).
docs/performance.md explains the figures.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ultratron.config import load_config
from ultratron.training.trainer import Trainer

LAYERS, WIDTH, HEADS, SEQ, BATCH, VOCAB = 6, 384, 6, 256, 8, 4096


def ultratron_args(precision: str, compile_: bool, run_dir: str, cpu_linear: str) -> list[str]:
    return [
        "--model.preset", "tiny", "--model.n_layers", str(LAYERS), "--model.dim", str(WIDTH),
        "--model.n_heads", str(HEADS), "--model.n_kv_heads", str(HEADS), "--model.ffn_dim", str(8 * WIDTH // 3),
        "--model.vocab_size", str(VOCAB), "--model.max_seq_len", str(SEQ),
        "--training.seq_len", str(SEQ), "--training.micro_batch_size", str(BATCH),
        "--training.batch_tokens", str(SEQ * BATCH), "--training.precision", precision,
        "--training.compile", str(compile_).lower(), "--training.steps", "100000", "--training.progress", "false",
        "--run.dir", run_dir, "--data.cache_dir", "runs/bench-data", "--run.tensorboard", "false",
        "--eval.interval", "0", "--health.check", "false", "--training.cpu_linear", cpu_linear,
    ]


# ---- the plain PyTorch GPT, as a user would write it --------------------------------------------
class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, seq: int, vocab: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight
        for module in self.modules():  # nanoGPT's initialisation: N(0, 0.02) weights, zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


class PlainStep:
    def __init__(self, tokens: np.ndarray, precision: str, compile_: bool):
        torch.manual_seed(0)
        self.model = GPT(LAYERS, WIDTH, HEADS, SEQ, VOCAB)
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        self.forward = torch.compile(self.model) if compile_ else self.model
        self.data = torch.from_numpy(tokens.astype(np.int64))
        self.bf16 = precision == "bf16"

    def __call__(self) -> float:
        ix = torch.randint(len(self.data) - SEQ - 1, (BATCH,))
        x = torch.stack([self.data[i:i + SEQ] for i in ix])
        y = torch.stack([self.data[i + 1:i + 1 + SEQ] for i in ix])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.forward(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def bench(precision: str, rounds: int, warmup: int, compile_: bool, plain_compile: bool, cpu_linear: str) -> dict:
    cfg = load_config(None, ultratron_args(precision, compile_, f"runs/bench-plain-{precision}", cpu_linear))
    trainer = Trainer(cfg, echo=False)
    tokens = np.concatenate([np.asarray(t) for t in trainer.train_loader.shards.tokens])
    plain = PlainStep(tokens, precision, plain_compile)
    times = {"ultratron": [], "plain": []}
    losses = {"ultratron": [], "plain": []}
    for i in range(rounds + warmup):
        for name, step in (("ultratron", lambda: trainer.train_step()["loss"]), ("plain", plain)):
            start = time.perf_counter()
            loss = step()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
                losses[name].append(loss)
    medians = {k: statistics.median(v) for k, v in times.items()}
    assert all(math.isfinite(x) for v in losses.values() for x in v)
    pairs = [plain_s / ours_s for ours_s, plain_s in zip(times["ultratron"], times["plain"], strict=True)]
    return {"medians": medians, "ratio": medians["plain"] / medians["ultratron"],
            "pair_ratio": statistics.median(pairs),
            "params": {"ultratron": trainer.n_params, "plain": count(plain.model)},
            "spread": {k: (min(v), max(v)) for k, v in times.items()},
            "loss": {k: v[-1] for k, v in losses.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20, help="measured A/B pairs per precision")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured pairs first (compilation, allocator)")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--compile", action="store_true", help="ultratron with training.compile=true")
    parser.add_argument("--plain-compile", action="store_true",
                        help="the plain model under torch.compile(model) too (the default: eager, as written)")
    parser.add_argument("--cpu-linear", default="onednn", choices=("onednn", "aten"),
                        help="ultratron's training.cpu_linear (onednn, opt-in in the trainer, is what the figures "
                             "in docs/performance.md measured)")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; "
          f"load average {load:.1f} at the start; {args.rounds} interleaved pairs after {args.warmup} warm-up")
    tokens = SEQ * BATCH
    for precision in args.precisions.split(","):
        r = bench(precision, args.rounds, args.warmup, args.compile, args.plain_compile, args.cpu_linear)
        m = r["medians"]
        print(f"\n{precision}: {r['params']['ultratron'] / 1e6:.2f}M (ultratron) vs {r['params']['plain'] / 1e6:.2f}M "
              f"(plain) parameters; compile: ultratron {args.compile}, plain {args.plain_compile}; "
              f"cpu_linear {args.cpu_linear}")
        for name in ("ultratron", "plain"):
            lo, hi = r["spread"][name]
            print(f"  {name:>9}: median step {m[name] * 1e3:7.1f} ms  {tokens / m[name]:8,.0f} tokens/s  "
                  f"(range {lo * 1e3:.0f}–{hi * 1e3:.0f} ms; last loss {r['loss'][name]:.3f})")
        print(f"  ratio (ultratron tokens/s ÷ plain tokens/s): {r['ratio']:.3f}× of the medians, "
              f"{r['pair_ratio']:.3f}× the median of the pairs' ratios")
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
