"""Peak memory and step time of one training step with and without the chunked loss
(`training.loss_chunk`) and activation offload (`training.offload_activations`), on this CPU.

  python benchmarks/loss_and_offload.py [--layers 1] [--vocab 32768] [--seq 2048] [--chunk 512] [--repeats 3]

The shape is the issue's: the tiny preset with a 32,768 vocabulary at seq 2,048, micro-batch 1, fp32,
one process, one thread. Peak: the step's allocations (`parallel.memory.AllocatedBytes`, kernel
scratch left out) during forward and backward, the gradients allocated before. Time: the median of
`--repeats` steps after one warm-up. On a CPU host and device are one memory: offload's copies
cost time and do not lower the peak (it counts what moved: "moved").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from ultratron.config import load_config  # noqa: E402
from ultratron.models.registry import build_model, plan_of  # noqa: E402
from ultratron.parallel.memory import AllocatedBytes  # noqa: E402
from ultratron.parallel.offload import apply_offload  # noqa: E402
from ultratron.training.loss import chunked_cross_entropy, cross_entropy, linear_cross_entropy  # noqa: E402

MIB = 2**20


def one_step(model, tokens, chunk: int, linear: bool = True) -> None:
    """One forward and backward: whole logits (chunk 0), or chunked — the plain head's loss the trainer
    runs for a Llama (`linear`), or the checkpointed chunks it runs for any other head."""
    if chunk:
        model.hidden_out = True
        hidden = model(tokens[:, :-1])
        model.hidden_out = False
        if linear:
            loss = linear_cross_entropy(hidden, model.output.weight, tokens[:, 1:], 0.0, chunk)[0]
        else:
            loss = chunked_cross_entropy(hidden, model.head, tokens[:, 1:], 0.0, chunk)[0]
    else:
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])[0]
    loss.backward()


def measure(args, chunk: int, offload: bool, linear: bool = True) -> dict:
    cfg = load_config(None, ["--model.preset", "tiny", "--model.n_layers", str(args.layers), "--model.vocab_size",
                             str(args.vocab), "--model.max_seq_len", str(args.seq), "--training.seq_len",
                             str(args.seq), "--training.micro_batch_size", "1", "--training.batch_tokens",
                             str(args.seq)])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    _, host = apply_offload(model, offload, plan_of(model))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tokens = torch.randint(0, args.vocab, (1, args.seq + 1), generator=torch.Generator().manual_seed(1))
    one_step(model, tokens, chunk, linear)  # warm-up
    with AllocatedBytes() as meter:
        one_step(model, tokens, chunk, linear)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        one_step(model, tokens, chunk, linear)
        times.append(time.perf_counter() - start)
    steps = args.repeats + 2  # the warm-up, the measured one, the timed ones
    return {"peak": meter.peak, "time": statistics.median(times), "moved": host.moved / steps if host else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=32_768)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"tiny, {args.layers} layer(s), vocabulary {args.vocab:,}, seq {args.seq:,}, micro-batch 1, fp32, "
          f"1 thread; planned fp32 logits {4 * args.seq * args.vocab / MIB:.0f} MiB")
    print("| loss_chunk | chunked loss | offload | peak MiB | step s | moved MiB a step |")
    print("|---|---|---|---|---|---|")
    for chunk, linear, offload in ((0, True, False), (args.chunk, True, False), (args.chunk, False, False),
                                   (0, True, True), (args.chunk, True, True)):
        r = measure(args, chunk, offload, linear)
        kind = "—" if not chunk else "linear" if linear else "checkpointed"
        print(f"| {chunk} | {kind} | {str(offload).lower()} | {r['peak'] / MIB:.0f} | {r['time']:.2f} | "
              f"{r['moved'] / MIB:.0f} |")


if __name__ == "__main__":
    main()
