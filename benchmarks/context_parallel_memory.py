"""Per-rank activation memory under context parallelism, measured on CPU (gloo, one thread per rank):
cp ranks each hold 1/cp of every sequence, so at cp 4 a rank keeps about a quarter of what one
process keeps for the same sequence — and trains a sequence 4× as long in what one process needs
for the short one.

Measured: the peak of the tensors autograd keeps alive for backward during one micro-batch's
forward and backward (parallel.memory.SavedActivations, which counts each storage once; the
parameters are not activations), on every rank; beside it `plan memory`'s estimate of activations
and loss logits for the same layout (planning.memory). The ring's K/V blocks in flight are
transient and not counted (one block of K and V at a time, p·T·2·kv/t, which `plan memory` books
under comm_buffers).

  python benchmarks/context_parallel_memory.py [--seq 1024] [--dim 256] [--layers 4] [--attention ring]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path


def measure(overrides: list[str], out: str) -> None:
    """This rank's activation peak over one micro-batch's forward and backward."""
    import torch.distributed as dist

    from ultratron.config import load_config
    from ultratron.parallel.memory import SavedActivations
    from ultratron.training.trainer import Trainer

    trainer = Trainer(load_config(None, overrides), echo=False)
    trainer.train_step()  # warm-up: first-call allocations, the ring's groups
    with SavedActivations(trainer.model) as meter:
        trainer.strategy.forward_backward(trainer.train_loader.next_batch, 1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(out, f"rank{rank}.json").write_text(json.dumps({"activations": meter.peak, "left": meter.live}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=1024, help="the sequence one process trains")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--attention", default="ring", choices=("ring", "allgather"))
    args = parser.parse_args()

    import torch

    from ultratron.config import load_config
    from ultratron.launch.local import run_local
    from ultratron.planning.layout import Layout
    from ultratron.planning.memory import estimate_memory

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="cp-memory-"))
    long = 4 * args.seq
    base = ["--model.preset", "tiny", "--model.n_layers", str(args.layers), "--model.dim", str(args.dim),
            "--model.n_heads", "8", "--model.n_kv_heads", "4", "--model.ffn_dim", str(3 * args.dim),
            "--model.vocab_size", "1024", "--model.max_seq_len", str(long), "--training.micro_batch_size", "1",
            "--training.steps", "100", "--training.progress", "false", "--training.sample_tokens", "0",
            "--run.tensorboard", "false", "--eval.interval", "0", "--data.max_bytes", "2000000",
            "--data.cache_dir", str(root / "data"), "--training.threads", "1",
            "--parallel.cp_attention", args.attention, "--health.check", "false"]
    print(f"dim {args.dim}, {args.layers} layers, fp32, one sequence per micro-batch, CPU with 1 thread per rank, "
          f"{args.attention} attention", file=sys.stderr)
    rows = []
    for cp, seq in ((1, args.seq), (2, args.seq), (4, args.seq), (4, long)):
        out = root / f"cp{cp}-{seq}"
        out.mkdir()
        overrides = base + ["--training.seq_len", str(seq), "--training.batch_tokens", str(seq),
                            "--parallel.cp", str(cp), "--run.dir", str(out / "run")]
        run_local(cp, measure, overrides, str(out))
        got = [json.loads((out / f"rank{r}.json").read_text())["activations"] for r in range(cp)]
        plan = estimate_memory(load_config(None, overrides).model,
                               Layout(cp=cp, seq_len=seq, micro_batch_size=1, precision="fp32"))
        rows.append((cp, seq, got, plan.activations + plan.loss_logits))
    shutil.rmtree(root, ignore_errors=True)

    one = max(rows[0][2])
    print(f"{'cp':>3} {'seq':>6} {'per-rank activations MiB (each rank)':<44} {'/ cp1':>6} {'plan MiB':>9}")
    for cp, seq, got, plan in rows:
        ranks = " ".join(f"{g / 2**20:.2f}" for g in got)
        print(f"{cp:>3} {seq:>6} {ranks:<44} {max(got) / one:>6.3f} {plan / 2**20:>9.2f}")
    print(f"cp 4 at seq {args.seq}: {max(rows[2][2]) / one:.3f} of one process (¼ = 0.25); "
          f"cp 4 at seq {long}: {max(rows[3][2]) / one:.3f} of one process at seq {args.seq}")


if __name__ == "__main__":
    main()
