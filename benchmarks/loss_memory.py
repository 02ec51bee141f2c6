"""Peak memory and step time of one training step with the whole-logits loss and with the chunked
head + loss (`training.loss_chunk`), on this CPU, for the tiny model with a large vocabulary.

    python benchmarks/loss_memory.py [--vocab 32768] [--seq 2048] [--chunks 0,512,2048] [--steps 5]

The peak is the suite's allocation meter over one forward and backward (`parallel.memory.AllocatedBytes`:
tensors the step creates, a kernel's own scratch left out); the time is the median of `--steps`
forward-and-backward passes after one warm-up. The planner's `loss_logits` (fp32 logits the plain
loss keeps for backward) is printed beside them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from conftest import TINY  # noqa: E402
from ultratron.config import load_config  # noqa: E402
from ultratron.parallel.memory import AllocatedBytes  # noqa: E402
from ultratron.planning.memory import estimate_memory  # noqa: E402
from ultratron.training.trainer import Trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--chunks", default="0,512,2048")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    shape = TINY + ["--model.vocab_size", str(args.vocab), "--training.seq_len", str(args.seq), "--model.max_seq_len",
                    str(args.seq), "--training.micro_batch_size", "1", "--training.batch_tokens", str(args.seq),
                    "--eval.interval", "0"]
    print(f"{torch.get_num_threads()} threads; tiny model, vocabulary {args.vocab}, {args.seq} tokens a step, fp32")
    print("| training.loss_chunk | step peak (MB) | step time (median, s) |\n|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for chunk in args.chunks.split(","):
            cfg = load_config(None, shape + ["--training.loss_chunk", chunk, "--run.dir", f"{tmp}/{chunk}"])
            trainer = Trainer(cfg, echo=False)
            batch = trainer.train_loader.next_batch()
            with AllocatedBytes() as meter:
                trainer.strategy.forward_backward(lambda batch=batch: batch, 1)
            times = []
            for _ in range(args.steps):
                started = time.perf_counter()
                trainer.strategy.forward_backward(lambda batch=batch: batch, 1)
                times.append(time.perf_counter() - started)
            print(f"| {chunk} | {meter.peak / 1e6:.0f} | {statistics.median(times):.3f} |")
        planned = estimate_memory(cfg.model, cfg.layout).loss_logits
    print(f"planned loss_logits (whole logits): {planned / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
