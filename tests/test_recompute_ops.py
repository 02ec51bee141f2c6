"""Selective recompute's save list (issue 45, part 3): it names the GPU kernels too — cuDNN, flash
and memory-efficient attention, FlexAttention, fp8's scaled matmul, sp's reduce-scatter and ep's
all-to-all (collectives whose outputs are shards) — and
every name resolves in this torch; on a CPU a selective-recompute step still equals one without
recompute, and its backward recomputes no matmul."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from ultratron.config import load_config
from ultratron.models.registry import build_model, plan_of
from ultratron.parallel import recompute

GPU_OPS = ["aten._scaled_dot_product_cudnn_attention.default", "aten._scaled_dot_product_flash_attention.default",
           "aten._scaled_dot_product_efficient_attention.default", "higher_order.flex_attention",
           "aten._scaled_mm.default", "_c10d_functional.reduce_scatter_tensor.default",
           "_c10d_functional.all_to_all_single.default"]


def test_every_name_resolves_in_this_torch():
    ops, missing = recompute.saved_ops()
    assert missing == []
    assert len(ops) == len(recompute.SAVED_OP_NAMES) + 1  # (and the oneDNN linear)


def test_a_name_this_torch_lacks_is_reported():
    assert recompute.resolve_op("aten.no_such_op_anywhere.default") is None


@pytest.mark.parametrize("name", GPU_OPS)
def test_gpu_kernels_are_saved(name):
    op = recompute.resolve_op(name)
    assert op is not None
    assert recompute._policy(None, op) == CheckpointPolicy.MUST_SAVE


def test_elementwise_ops_are_recomputed():
    assert recompute._policy(None, torch.ops.aten.mul.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _grads(mode: str) -> tuple[list[torch.Tensor], dict[str, int]]:
    cfg = load_config(None, ["--model.preset", "tiny", "--model.n_layers", "2", "--model.dim", "64",
                             "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.ffn_dim", "128",
                             "--model.vocab_size", "256"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    recompute.apply_recompute(model, mode, plan_of(model))
    tokens = torch.randint(0, 256, (2, 32))
    loss = model(tokens).float().logsumexp(-1).mean()
    with CountOps() as backward:
        loss.backward()
    return [p.grad for p in model.parameters()], backward.counts


def test_selective_recompute_on_cpu_is_the_same_step_and_recomputes_no_matmul():
    plain, plain_ops = _grads("none")
    selective, selective_ops = _grads("selective")
    for a, b in zip(plain, selective, strict=True):
        assert torch.equal(a, b)
    # backward's matmuls are the gradients' own: as many with selective recompute as without
    assert selective_ops.get("mm", 0) == plain_ops.get("mm", 0) > 0
    assert selective_ops.get("_scaled_dot_product_flash_attention_for_cpu", 0) == 0
