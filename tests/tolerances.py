"""How close two computations of the suite must agree: the one derivation (docs/testing.md).

Every comparison of two training runs in tests/ takes its tolerance from here, so that a number
fitted to one CPU cannot hide in a test file. `tests/test_tolerance_literals.py` lists the literal
tolerances that remain elsewhere and why each compares something else. CI runs the numerically
sensitive tests a second time with the CPU kernels on another instruction set (`.ci/run`), where
a tolerance fitted to this machine's rounding fails instead of on a user's.

fp32 rounds each operation to 2^-24 ≈ 6e-8 of its result (bf16 to 2^-8 ≈ 4e-3, fp8 e4m3 to
2^-4 ≈ 6e-2). Which kernels a CPU runs decides the order of every sum: MKL's sgemm blocks by
the vector width it chooses (AVX-512 on Intel, AVX2 on AMD, FMA or not), ATen's reductions and
softmax likewise; so two runs that differ in layout, or one run on two CPUs, round differently.

LAYOUTS  N ranks of a layout against one process on the same global batch (dist_common's
         `assert_equivalent`): relative gaps of losses, validation losses and gradient norms, and
         each final weight tensor's gap as a share of how far the one-process run moved it
         (|W − W_ref| / |W_ref − W_init|, Frobenius). Only the summation order differs in fp32, but
         AdamW divides each gradient by its running RMS, so an element whose gradient is at
         round-off level moves by ~lr either way: that shows in the weights long before it shows in
         a loss, and it is why weights are never compared element by element at a fixed atol (an
         expert weight of the ep2×dp2 run, 4e-2 in size, differs by 1.1e-6 on one Xeon, by 1.9×
         allclose(rtol=1e-5, atol=1e-6)'s bound under MKL's AVX code path: issue 38). The largest gaps
         over every layout of the suite, first on a 2-core AMD EPYC (the tolerances were set there,
         about 3× these), then on a 2-core Xeon (AVX-512, AMX) in `make test` / in the second pass:
           fp32  losses 1e-5: measured ≤ 2.3e-7 / 2.3e-7 / 2.3e-7; gradient norms 1e-4: ≤ 1.6e-6 /
                 1.3e-6 / 2.2e-6; weights 3e-4 of their update: ≤ 6.5e-5 / 5.7e-5 / 4.1e-5.
           bf16  losses 2e-4: ≤ 4.6e-5 / 4.7e-5 / 5.7e-5; norms 1e-2: ≤ 3.4e-3 / 3.0e-3 / 3.5e-3;
                 weights 0.2: ≤ 6.3e-2 / 4.9e-2 / 6.7e-2. FSDP2 gathers bf16 weights and keeps a
                 bf16 residual stream where one process's autocast keeps fp32, and tensor
                 parallelism sums partial products in another order.
           fp8   (against fp8 in one process) losses 2e-3: ≤ 1.1e-4 / 1.3e-4 / 9.2e-5; norms 5e-2:
                 ≤ 1.8e-2 / 2.7e-2 / 1.1e-2; weights 0.4: ≤ 0.14 / 0.15 / 0.14. bf16's sources, and
                 a cast of a differently rounded tensor can land one fp8 step (2^-4) away.
REPLAY   The same computation twice in one process on one machine: a resume against the run that
         kept going, a validation pass of the same weights on the same batches in two runs, a loss
         whose only change is a term the logged value leaves out. Same kernels, same shapes, same
         order: no difference is expected. The tolerance, relative 1e-6 (16 fp32 roundings), allows
         a kernel to split a differently placed buffer another way on some machine; a real fault (a
         data position off by one: another batch; a lost optimizer moment) moves a loss by far more.
         A whole group killed and restarted from a checkpoint under torchrun is compared with the
         uninterrupted run as a layout is (LAYOUTS' weights): its ranks' gloo reductions run again,
         and a restart that lost state (an optimizer moment, a data position) moves the weights by
         a large share of their update, not by round-off.
KERNELS  The same training with other kernels for the same math: torch.compile's fused blocks
         (Inductor fuses the norms and activations and reorders their sums), oneDNN's matmul for
         MKL's (`training.cpu_linear onednn`). Losses relative 1e-4 over five steps: each step's
         roundings differ everywhere (a matmul's 1e-6, kernels/cpu_linear.py), and AdamW's
         division by the gradients' RMS carries the difference into the next steps' losses.
CHUNKED  The same training with the output head and loss computed a chunk of tokens at a time
         (`training.loss_chunk`): the same per-token terms summed in chunks and the head's weight
         gradient summed over them, in fp32 a few roundings per step (√n·2^-24 ≈ 2.7e-6 for 2,048
         terms at worst-typical; measured ≤ 2 ulp of the loss). Losses and validation losses relative
         1e-6 (issue 40's bound), gradient norms 1e-5 (a norm over every gradient element, each a
         regrouped sum: tests/test_grad_accum.py's bound).
PRECISION One run in bf16 (or fp8) against the same run in fp32 (or bf16): bf16 rounds every
         activation to 2^-8; over 30 tiny steps each loss within 1e-3 relative of fp32's (measured
         ≤ 1.6e-4), gradient norms within 1e-2 in the median (measured 4e-4; single steps differ
         by up to 9%, as rounding shifts which batch elements dominate). fp8 against bf16 over 200
         steps: the mean of the last ten losses within 2%. Past step ~50 any two runs that round
         differently part ways and land on other trajectories of the same training, so this bounds
         trajectory noise, not fp8's rounding: with one micro-batch of 256 tokens a step, bf16 alone
         ended 2.4% apart on one Xeon with oneDNN on AMX and without (fp8 against bf16 there: 2.7%;
         0.9% on AMD), so the test takes two micro-batches a step, where fp8 against bf16 measured
         0.6% on the Xeon and 1.0% with the second pass's kernels (bf16 alone between the two: 0.6%).
         Measured with a tokenizer that leaves numbers whole, which tests/test_fp8.py keeps: with
         digits cut in groups (the default since issue 46) the same runs end 2.25% apart, fp8 lower.
SERVING_BF16 The server's log-probabilities with `--dtype bf16` against `--dtype fp32`, same prompts
         (tests/evaluation/test_serve_dtype.py). bf16 keeps 8 significant bits: every weight, and
         every activation a layer writes, is rounded to within u = 2^-8 of itself. A forward of an
         L-layer Llama rounds the residual stream ~8 times per layer (norm, q/k/v, attention output,
         the FFN's three matmuls, two residual adds) and twice more at the end (final norm, output
         head): R = 8L + 2 roundings, independent, so the final hidden state h is off by about
         u·√R of its norm. A logit z_j = h·w_j is then off by at most u·√R·|h|·|w_j| (Cauchy–Schwarz),
         and log p_j = z_j − logsumexp(z) by at most twice the largest logit error:
         |Δ log p| ≤ 2·u·√R·max|h|·max_j|w_j|. `bf16_logprob_bound` computes it from the model's
         depth and its fp32 norms; nothing in it is fitted (measured: 1/16 of it, 0.017 of 0.26 nats).
"""

from __future__ import annotations

import math

FP32_ROUNDING = 2.0**-24

LAYOUTS = {"fp32": {"loss": 1e-5, "grad_norm": 1e-4, "val_loss": 1e-5, "weights": 3e-4},
           "bf16": {"loss": 2e-4, "grad_norm": 1e-2, "val_loss": 2e-4, "weights": 0.2},
           "fp8": {"loss": 2e-3, "grad_norm": 5e-2, "val_loss": 2e-3, "weights": 0.4}}
REPLAY = 16 * FP32_ROUNDING  # ≈ 1e-6, relative
KERNELS_LOSS = 1e-4  # relative
CHUNKED = {"loss": 1e-6, "val_loss": 1e-6, "grad_norm": 1e-5}  # relative
PRECISION = {"bf16_loss": 1e-3, "bf16_grad_norm_median": 1e-2, "fp8_final_loss": 2e-2}  # relative


def relative_gap(got: float, expected: float) -> float:
    return abs(got - expected) / abs(expected)


def replayed(got: float, expected: float) -> bool:
    """`got` is `expected` computed again (REPLAY)."""
    return relative_gap(got, expected) <= REPLAY


BF16_UNIT = 2.0**-8  # bf16's 8 significant bits


def bf16_logprob_bound(n_layers: int, hidden_norm: float, head_row_norm: float) -> float:
    """How far a bf16 forward's log-probabilities may be from fp32's (SERVING_BF16)."""
    return 2 * BF16_UNIT * math.sqrt(8 * n_layers + 2) * hidden_norm * head_row_norm

# Attention backends against the whole dense mask, the same inputs (tests/test_attention.py derives them):
FP32_ATTENTION = 1e-6  # absolute, on outputs and gradients of magnitude ~1-4
BF16_ATTENTION = 0.14  # absolute: flex on bf16 inputs against fp32 on the same values (its worst case)

# A prompt log-probability (echo) served from the serving prefix cache against the same request with
# the cache off (tests/evaluation/test_serve_prefix_cache.py): the same fp32 forward of the same
# tokens, in another batch (other rows, other padding, the prefix computed in an earlier pass), so
# only the order of fp32 sums differs: n·2^-24 of logits of a few units, n up to a few hundred terms.
PREFIX_CACHE = 1e-5  # absolute, nats (the bound issue 47 sets)

# A token log-probability from the paged KV cache under memory pressure (a small pool: prompts wait
# for blocks, running rows are preempted and their tokens computed again) against the same request
# with a pool that never runs short (tests/evaluation/test_serve_paged_kv.py): the same fp32 forward
# in another batch (other rows, other padding, a preempted row's tokens in one prefill instead of one
# decode step each), so only the order of fp32 sums differs. Measured: 4.8e-7 on the test's model.
PAGED_KV = 1e-6  # absolute, nats (the bound the paging task sets)
