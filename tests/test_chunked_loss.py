"""training.loss_chunk: the head and the cross-entropy a chunk of tokens at a time (kernels/chunked_loss.py).

The chunked loss sums the same per-token terms as `training.loss.cross_entropy`, a chunk at a
time, and its backward forms each chunk's gradient from recomputed logits: in fp32 only the
summation order differs. Tolerances: the loss and z-loss relative 1e-6 (sums of ≤ 600 terms of
fp32, √n·2^-24 ≈ 1.5e-6 at worst in practice far less: measured ≤ 1.2e-7); each gradient within
1e-5 of its tensor's largest element (the weight's gradient adds ≤ 600 token contributions in
another grouping, n·2^-24 ≈ 3.6e-5 bound, measured ≤ 1.5e-6). Training runs take theirs from
tests/tolerances.py (CHUNKED_LOSS).
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY
from tolerances import CHUNKED_LOSS, LAYOUTS, relative_gap
from ultratron.config import load_config
from ultratron.errors import ConfigError
from ultratron.kernels.chunked_loss import DeferredHead, HeadInput, chunked_cross_entropy, defer_head, deferred
from ultratron.parallel.memory import AllocatedBytes
from ultratron.planning.memory import estimate_memory
from ultratron.training.loss import IGNORE, cross_entropy
from ultratron.training.metrics import read_metrics
from ultratron.training.trainer import Trainer


def _both(chunk: int, z_loss: float, dtype=None):
    torch.manual_seed(0)
    batch, seq, dim, vocab = 3, 200, 32, 97
    hidden = torch.randn(batch, seq, dim, requires_grad=True)
    weight = (torch.randn(vocab, dim) * 0.3).requires_grad_()
    targets = torch.randint(0, vocab, (batch, seq))
    targets[0, :50] = IGNORE  # a prompt that does not count
    targets[2, 7] = IGNORE
    out = {}
    for name in ("plain", "chunked"):
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            if name == "plain":
                loss, ce = cross_entropy(torch.nn.functional.linear(h, w), targets, z_loss)
            else:
                loss, ce = chunked_cross_entropy(HeadInput(h, w), targets, z_loss, chunk)
        loss.backward()
        out[name] = (float(loss), float(ce), h.grad, w.grad)
    return out


@pytest.mark.parametrize("chunk", [1, 64, 599, 600, 4096])
@pytest.mark.parametrize("z_loss", [0.0, 0.1])
def test_the_chunked_loss_and_its_gradients_equal_the_plain_ones(chunk, z_loss):
    out = _both(chunk, z_loss)
    (loss, ce, grad_h, grad_w), (c_loss, c_ce, c_grad_h, c_grad_w) = out["plain"], out["chunked"]
    assert relative_gap(c_loss, loss) <= 1e-6 and relative_gap(c_ce, ce) <= 1e-6, (loss, c_loss, ce, c_ce)
    for got, want in ((c_grad_h, grad_h), (c_grad_w, grad_w)):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
    assert grad_h[0, :50].abs().max() == 0 and c_grad_h[0, :50].abs().max() == 0  # ignored tokens: no gradient


def test_under_bf16_autocast_it_rounds_as_the_plain_path_does():
    """The chunk's matmul runs in bf16 as autocast runs the head's; the loss is fp32 either way. bf16
    products of 32 terms (2^-8 each) make the logits differ by ~1e-3 at most: loss within 1e-4."""
    out = _both(64, 0.0, torch.bfloat16)
    assert relative_gap(out["chunked"][0], out["plain"][0]) <= 1e-4
    assert relative_gap(_both(64, 0.0)["plain"][0], out["plain"][0]) > 1e-6  # bf16 really rounded


def test_a_deferred_head_is_the_same_layer_until_deferred():
    linear = torch.nn.Linear(8, 5, bias=False)
    model = torch.nn.Module()
    model.output = linear
    head = defer_head(model)
    assert isinstance(model.output, DeferredHead) and model.output.weight is linear.weight  # a tie stays a tie
    x = torch.randn(2, 8)
    assert torch.equal(head(x), linear(x))
    with deferred(model):
        handed = head(x)
    assert isinstance(handed, HeadInput) and handed.hidden is x and handed.weight is linear.weight
    assert torch.equal(head(x), linear(x))  # and back


def test_training_with_chunks_equals_training_without(tiny_overrides, tmp_path):
    """Ten fp32 steps with z-loss and validation: losses, gradient norms and validation losses as the
    plain head gives them (tests/tolerances.py, CHUNKED_LOSS), and the same weights at the end."""
    base = tiny_overrides + ["--training.steps", "10", "--eval.interval", "5", "--training.z_loss", "1e-3"]
    runs = {}
    for chunk in ("0", "37"):
        cfg = load_config(None, base + ["--training.loss_chunk", chunk, "--run.dir", str(tmp_path / chunk)])
        trainer = Trainer(cfg, echo=False)
        initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.fit()
        runs[chunk] = ([r for r in read_metrics(cfg.run.dir) if "loss" in r or "val_loss" in r],
                       {k: v.clone() for k, v in trainer.model.state_dict().items()})
    (plain, plain_weights), (chunked, chunked_weights) = runs["0"], runs["37"]
    assert [r["step"] for r in plain] == [r["step"] for r in chunked] and len(plain) >= 10
    for a, b in zip(plain, chunked, strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in a:
                assert relative_gap(b[key], a[key]) <= CHUNKED_LOSS, (key, a, b)
    # the weights as a share of their update, as layouts are compared (tests/tolerances.py, LAYOUTS)
    gap = max(float((chunked_weights[k] - w).norm() / (w - initial[k]).norm()) for k, w in plain_weights.items()
              if (w - initial[k]).norm() > 0)
    assert gap <= LAYOUTS["fp32"]["weights"], gap


def test_the_step_s_peak_falls_by_at_least_the_planned_logits(tmp_path):
    """Issue 40's shape: the tiny model with a 32,768-token vocabulary and 2,048-token sequences,
    one step in fp32. The plain step holds the fp32 logits (planned: `loss_logits`, 268 MB) and
    their gradients; the chunked one a 512-token chunk's. Measured with the suite's allocation
    meter (parallel.memory.AllocatedBytes), its peak falls by more than the planned logits."""
    torch.set_num_threads(2)
    shape = TINY + ["--model.vocab_size", "32768", "--training.seq_len", "2048", "--model.max_seq_len", "2048",
                    "--training.micro_batch_size", "1", "--training.batch_tokens", "2048", "--training.steps", "1",
                    "--eval.interval", "0"]
    peaks = {}
    for chunk in ("0", "512"):
        cfg = load_config(None, shape + ["--training.loss_chunk", chunk, "--run.dir", str(tmp_path / chunk)])
        trainer = Trainer(cfg, echo=False)
        batch = trainer.train_loader.next_batch()
        with AllocatedBytes() as meter:
            trainer.strategy.forward_backward(lambda batch=batch: batch, 1)
        peaks[chunk] = meter.peak
    planned = estimate_memory(cfg.model, cfg.layout).loss_logits
    assert planned >= 4 * 2048 * 32768
    assert peaks["0"] - peaks["512"] >= planned, (peaks, planned)
    print(f"step peak {peaks['0'] / 1e6:.0f} MB → {peaks['512'] / 1e6:.0f} MB; planned logits {planned / 1e6:.0f} MB")


def test_layouts_the_chunked_loss_cannot_take_yet_are_refused_in_one_line():
    for extra, words in ((["--parallel.tp", "2", "--model.n_kv_heads", "2"], "parallel.tp"),
                         (["--parallel.dp", "2", "--parallel.zero", "3"], "parallel.zero = 3"),
                         (["--model.final_softcap", "30"], "final_softcap")):
        with pytest.raises(ConfigError) as err:
            load_config(None, TINY + ["--training.loss_chunk", "64", *extra])
        assert any(words in p and "training.loss_chunk = 64" in p for p in err.value.problems), err.value.problems
    with pytest.raises(ConfigError, match="must be ≥ 0"):
        load_config(None, TINY + ["--training.loss_chunk", "-1"])
