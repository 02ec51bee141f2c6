"""Validation never holds more than the training step: with `training.loss_chunk` it runs the step's
forward and chunked loss without backward (`TrainStep.eval_loss`), so the (tokens × vocabulary)
logits the step never makes are not made for validation either.

The shape is the chunked loss's acceptance shape (tests/test_chunked_loss.py): the tiny preset with
a 32,768 vocabulary at seq 2,048, micro-batch 1, chunks of 512 tokens; the bytes are counted by the
suite's allocation meter (`parallel.memory.AllocatedBytes`, torch.profiler's allocator events).

Tolerance (fp32): validation's loss against the whole-logits validation the trainer ran before (the
model's logits, then `cross_entropy`) is the same per-token terms — each token's log-sum-exp over the
whole vocabulary minus its target's logit — added in chunks instead of in one sum: tests/tolerances.py,
CHUNKED's validation loss (1e-6 relative; √n·2^-24 ≈ 2.7e-6 worst-typical for n = 2,048 terms,
measured ≤ 2 ulp). A chunk's rows misplaced, or a target off by one position, moves it by orders of
magnitude more (the untrained model's per-token losses differ by about 1e-2 of their mean).
"""

from __future__ import annotations

import pytest
import torch

from tolerances import CHUNKED, relative_gap
from ultratron.config import load_config
from ultratron.models.registry import build_model
from ultratron.parallel.memory import AllocatedBytes
from ultratron.parallel.parallelize import parallelize, topology
from ultratron.training.loss import cross_entropy
from ultratron.training.step import TrainStep

VOCAB, SEQ, CHUNK = 32_768, 2048, 512


def _step(z_loss: float, extra: list[str]) -> TrainStep:
    cfg = load_config(None, ["--model.preset", "tiny", "--model.vocab_size", str(VOCAB), "--model.max_seq_len",
                             str(SEQ), "--training.seq_len", str(SEQ), "--training.micro_batch_size", "1",
                             "--training.batch_tokens", str(SEQ), "--training.precision", "fp32",
                             "--training.loss_chunk", str(CHUNK), *extra])
    torch.manual_seed(0)
    parallel = parallelize(build_model(cfg.model), topology(cfg.layout), cfg)
    return TrainStep(parallel, torch.device("cpu"), "fp32", z_loss, loss_chunk=CHUNK)


@pytest.mark.parametrize("extra", [[], ["--model.final_softcap", "30"]], ids=["linear", "checkpointed"])
def test_validation_peak_is_at_most_the_steps_and_its_loss_the_whole_logits_one(extra):
    """The plain head's linear loss (the trainer's for a Llama) and any other head's checkpointed
    chunks (a soft-capped head); with z-loss on, which validation leaves out of what it reports."""
    torch.set_num_threads(1)
    step = _step(1e-3, extra)
    model = step.runner.model
    tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=torch.Generator().manual_seed(2))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    for p in model.parameters():  # gradients allocated before the measured stretch (AllocatedBytes' rule)
        p.grad = torch.zeros_like(p)

    with AllocatedBytes() as training:
        step.forward_backward(lambda: (inputs, targets), 1)
    with AllocatedBytes() as validation:
        val_loss = step.eval_loss(inputs, targets)
    with AllocatedBytes() as whole, torch.no_grad():  # what validation ran before: whole logits
        model.eval()
        whole_loss = float(cross_entropy(model(inputs), targets)[1])
    print(f"peak bytes: training step {training.peak}, validation {validation.peak}, whole-logits "
          f"validation {whole.peak}")

    print(f"validation loss {val_loss!r}, whole-logits {whole_loss!r}: relative gap "
          f"{relative_gap(val_loss, whole_loss):.2e}")
    assert validation.peak <= training.peak, (validation.peak, training.peak)
    assert whole.peak > training.peak  # (the comparison above is one the whole-logits validation failed)
    assert relative_gap(val_loss, whole_loss) <= CHUNKED["val_loss"], (val_loss, whole_loss)
