"""Mixture of experts (models/moe.py): the layer computes what its definition says, the balancing
losses push the way they should, capacity drops what it must, and the presets have the published
sizes. (Training under expert parallelism against one process: tests/distributed/test_dist_cp_ep.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import run_cli
from ultratron.config import load_config
from ultratron.models.moe import MoE
from ultratron.models.presets import PRESETS
from ultratron.models.registry import build_model
from ultratron.planning.params import count_params_of


def _moe(score="softmax", shared=False, **router) -> MoE:
    from ultratron.models.llama.model import FeedForward

    torch.manual_seed(0)
    moe = MoE(16, 4, 2, 24, FeedForward(16, 24) if shared else None, score=score, **router)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


@pytest.mark.parametrize("score,shared,norm", [("softmax", False, True), ("sigmoid", True, True),
                                               ("softmax", True, False)])
def test_the_layer_is_the_weighted_sum_of_each_tokens_top_k_experts(score, shared, norm):
    moe = _moe(score, shared, norm_topk=norm).eval()
    x = torch.randn(3, 5, 16)
    got = moe(x)
    e = moe.experts
    for t, token in enumerate(x.reshape(-1, 16)):
        logits = moe.router.gate(token)
        scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
        top = scores.topk(2)
        weights = top.values / top.values.sum() if norm else top.values
        expected = sum(w * (F.silu(token @ e.w1[i].t()) * (token @ e.w3[i].t())) @ e.w2[i].t()
                       for w, i in zip(weights, top.indices, strict=True))
        if shared:
            expected = expected + moe.shared(token)
        torch.testing.assert_close(got.reshape(-1, 16)[t], expected, rtol=1e-5, atol=1e-6)


def test_the_balancing_loss_gradient_is_alpha_times_switch_loss_gradient():
    """The aux loss joins in backward only: its gradient on the router equals that of
    α·E·Σ f_i·P_i computed by hand (scaled by the micro-batch's weight)."""
    moe = _moe(aux_loss=0.01).train()
    moe.router.aux_loss_scale = 0.5
    x = torch.randn(32, 16)
    (moe(x) * 0).sum().backward()  # nothing but the balancing loss reaches the router
    got = moe.router.gate.weight.grad.clone()
    scores = moe.router.gate(x).softmax(-1)
    f = torch.bincount(scores.topk(2).indices.flatten(), minlength=4).float() / (32 * 2)
    aux = 4 * (f * scores.mean(0)).sum()
    (expected,) = torch.autograd.grad(0.01 * 0.5 * aux, moe.router.gate.weight)
    torch.testing.assert_close(got, expected)
    load, dropped, aux_sum, micro_batches = moe.router.totals()
    assert micro_batches == 1 and load.sum() == 64 and dropped == 0
    torch.testing.assert_close(aux_sum, aux.detach())


def test_aux_loss_pushes_the_busiest_expert_down():
    moe = _moe(aux_loss=1.0).train()
    with torch.no_grad():
        moe.router.gate.weight[0] += 0.1  # expert 0 favoured for positive inputs (half the mass)
    x = torch.rand(64, 16)
    (moe(x) * 0).sum().backward()
    before = moe.router.gate(x).softmax(-1)[:, 0].mean()
    with torch.no_grad():
        moe.router.gate.weight -= moe.router.gate.weight.grad
    assert moe.router.gate(x).softmax(-1)[:, 0].mean() < 0.5 * before


def test_capacity_drops_the_overflow_in_training_and_nothing_when_dropless_or_evaluating():
    x = torch.rand(40, 16)
    skewed = _moe(capacity_factor=1.0).train()
    with torch.no_grad():
        skewed.router.gate.weight[0] += 3.0  # almost every token picks expert 0 first
    out = skewed(x)
    out.sum().backward()
    capacity = skewed.router.capacity(40)
    assert capacity == 20 and skewed.router.totals()[1] > 0
    choice, _, keep = skewed.router(x)
    assert int(keep[choice == 0].sum()) == capacity  # the first 20 in token order, no more
    assert skewed.router.totals()[1] == int((~keep).sum())
    dropless = _moe().train()
    dropless(x).sum().backward()
    assert dropless.router.totals()[1] == 0 and dropless.router.totals()[0].sum() == 80
    skewed.eval()
    assert skewed.router(x)[2] is None  # evaluation is dropless


def test_a_token_whose_slots_are_all_dropped_passes_nothing_but_the_shared_expert():
    moe = _moe(shared=True, capacity_factor=1.0).train()
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[:2] += 5.0  # experts 0 and 1 for all 8: each takes 4
    x = torch.rand(8, 16)
    choice, weights, keep = moe.router(x)
    out = moe(x)
    dropped = ~keep.any(-1)
    assert dropped.any()
    torch.testing.assert_close(out[dropped], moe.shared(x[dropped]))


def test_bias_update_moves_toward_even_load():
    moe = _moe(bias_update=0.001)
    moe.router.update_bias(torch.tensor([10.0, 2.0, 2.0, 2.0]))
    torch.testing.assert_close(moe.router.expert_bias, torch.tensor([-0.001, 0.001, 0.001, 0.001]))
    assert "router.expert_bias" in moe.state_dict()  # checkpointed with the weights


def test_statistics_count_each_micro_batch_once_under_full_recompute():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    moe = _moe().train()
    wrapped = checkpoint_wrapper(moe, preserve_rng_state=False)
    wrapped(torch.randn(2, 8, 16)).sum().backward()
    assert moe.router.totals()[3] == 1 and moe.router.totals()[0].sum() == 32


def test_published_mixture_of_experts_sizes():
    """Totals and active parameters against the published figures (Mixtral: Jiang et al. 2024;
    Qwen3-30B-A3B: the Qwen3 model card; DeepSeek-V3: DeepSeek-AI 2024). Active includes both the
    embedding and the head; the published actives (12.9B, 3.3B, 37B) come within 2 %."""
    mixtral, qwen3, deepseek = (count_params_of(PRESETS[n]) for n in ("mixtral-8x7b", "qwen3-30b-a3b",
                                                                       "deepseek-v3-like"))
    assert round(mixtral.total / 1e9, 1) == 46.7 and abs(mixtral.active / 12.9e9 - 1) < 0.02
    assert round(qwen3.total / 1e9, 1) == 30.5 and abs(qwen3.active / 3.3e9 - 1) < 0.02
    # DeepSeek-V3 has multi-head latent attention (MLA), which ultratron does not implement: its
    # preset keeps multi-head attention of the same width. Like with like: our count with the
    # attention swapped for MLA's (q_lora_rank 1536, kv_lora_rank 512, 128 heads of 128 + 64 rope
    # dims for q·k and 128 for v; from DeepSeek-V3's config.json) is the published 671B.
    h, layers, heads = 7168, 61, 128
    mla = (h * 1536 + 1536 + 1536 * heads * (128 + 64) + h * (512 + 64) + 512 + 512 * heads * (128 + 128)
           + heads * 128 * h)
    ours = 4 * h * h  # wq, wk, wv, wo of 128 heads of 56
    assert round((deepseek.total - layers * (ours - mla)) / 1e9) == 671
    assert abs((deepseek.active - layers * (ours - mla)) / 37e9 - 1) < 0.02


@pytest.mark.parametrize("preset", ["moe-tiny", "qwen3-30b-a3b", "deepseek-v3-like"])
def test_moe_presets_build_with_the_counted_parameters(preset):
    cfg = load_config(None, ["--model.preset", preset, "--training.seq_len", "64"])
    model = build_model(cfg.model, "meta")
    counts = count_params_of(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == counts.total
    assert counts.active < counts.total


def test_bad_moe_layouts_give_one_error_line_and_exit_2():
    for args, expected in [
        (["--parallel.cp", "3"], "parallel.cp=3 does not divide the sequence length 256"),
        (["--model.preset", "moe-tiny", "--parallel.dp", "3", "--parallel.ep", "3", "--training.batch_tokens",
          "6144"], "parallel.ep=3 does not divide model.n_experts=8"),
        (["--model.preset", "moe-tiny", "--parallel.ep", "2"], "parallel.ep=2 does not divide parallel.dp=1"),
        (["--parallel.dp", "2", "--parallel.ep", "2"], "needs a mixture-of-experts model"),
    ]:
        result = run_cli("train", *args)
        assert result.returncode == 2, result.stderr
        lines = [x for x in result.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
