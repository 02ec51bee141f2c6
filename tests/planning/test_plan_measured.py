"""`plan memory` against the real model on CPU: static terms from the tensors, activations from
what autograd saves for backward (torch.autograd.graph.saved_tensors_hooks)."""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from ultratron.config import ModelConfig
from ultratron.models.llama.model import FeedForward, RMSNorm, build_model
from ultratron.planning.memory import Layout, estimate_memory


def apply_recompute(model, mode: str) -> None:
    """ultratron's recompute modes; reentrant checkpoints, so the saved-tensor hooks see what they keep."""
    ckpt = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    if mode == "full":
        for layer in model.layers.values():
            layer.forward = functools.partial(ckpt, layer.forward)
    elif mode == "selective":
        for module in list(model.modules()):
            if isinstance(module, RMSNorm):
                module.forward = functools.partial(ckpt, module.forward)
            elif isinstance(module, FeedForward):
                module.forward = lambda x, m=module: m.w2(ckpt(_swiglu, m.w1(x), m.w3(x)))


def _swiglu(gate, up):
    return F.silu(gate) * up


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(model_cfg: ModelConfig, layout: Layout) -> dict[str, int]:
    torch.manual_seed(0)
    model = build_model(model_cfg)
    dtype = torch.bfloat16 if layout.precision == "bf16" else torch.float32
    model.to(dtype)
    apply_recompute(model, layout.recompute)
    params = list(model.parameters())
    constant = {t.untyped_storage().data_ptr() for t in params + list(model.buffers())}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in constant:  # weights saved by matmuls are parameters, not activations
            saved[storage.data_ptr()] = storage.nbytes()  # views of one storage count once
        return tensor

    tokens = torch.randint(0, model_cfg.vocab_size, (layout.mbs, layout.seq + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    activations = sum(saved.values())
    loss.backward()

    out = {"parameters": tensor_bytes(params), "gradients": tensor_bytes(p.grad for p in params)}
    if layout.precision == "bf16":
        master = [p.detach().float().requires_grad_() for p in params]
        for m, p in zip(master, params, strict=True):
            m.grad = p.grad.float()
        out["master_weights"] = tensor_bytes(master)
        # Without the persistent fp32 buffer the step converts the bf16 grads on the fly.
        out["grad_accum_buffer"] = tensor_bytes(m.grad for m in master) if layout.fp32_grad_accum else 0
    else:
        master, out["master_weights"], out["grad_accum_buffer"] = params, 0, 0
    optimizer = torch.optim.AdamW(master, lr=1e-3, foreach=False)
    optimizer.step()
    out["optimizer_states"] = tensor_bytes(
        v for state in optimizer.state.values() for k, v in state.items() if k != "step")
    out["activations_and_loss"] = activations
    return out


SMALL = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=256, max_seq_len=128,
             tie_embeddings=False, rope_theta=10_000.0)
MOE = dict(n_experts=4, n_active_experts=2, expert_ffn_dim=96)  # a mixture of experts (planning.experts)

CASES = [
    (dict(SMALL), Layout(mbs=2, seq=64, recompute="none", precision="fp32")),
    (dict(SMALL), Layout(mbs=2, seq=64, recompute="selective", precision="fp32")),
    (dict(SMALL), Layout(mbs=2, seq=64, recompute="full", precision="fp32")),
    (dict(SMALL), Layout(mbs=2, seq=64, recompute="none", precision="bf16", fp32_grad_accum=True)),
    (dict(SMALL, n_kv_heads=4, tie_embeddings=True), Layout(mbs=1, seq=128, recompute="selective",
                                                           precision="bf16")),
    (dict(SMALL, n_layers=3, dim=96, n_heads=6, n_kv_heads=1, ffn_dim=256), Layout(
        mbs=3, seq=32, recompute="full", precision="bf16")),
    (dict(SMALL, qk_norm=True), Layout(mbs=2, seq=64, recompute="none", precision="fp32")),
    (dict(SMALL, qk_norm=True, n_layers=4), Layout(mbs=1, seq=96, recompute="selective", precision="bf16")),
    (dict(SMALL, **MOE), Layout(mbs=2, seq=64, recompute="none", precision="fp32")),
    (dict(SMALL, **MOE, n_shared_experts=1, n_layers=3, n_dense_layers=1), Layout(mbs=2, seq=64, recompute="none",
                                                                                 precision="bf16")),
]


@pytest.mark.parametrize("fields,layout", CASES, ids=[f"{i}-{c[1].precision}-{c[1].recompute}"
                                                       for i, c in enumerate(CASES)])
def test_plan_memory_matches_the_real_model(fields, layout):
    torch.set_num_threads(1)
    model_cfg = ModelConfig(preset=None, **fields)
    # On CPU ultratron runs bf16 attention in fp32 (models.llama.model.sdpa_attention), so autograd saves that.
    layout = dataclasses.replace(layout, attention_fp32=layout.precision == "bf16")
    measured = measure(model_cfg, layout)
    planned = estimate_memory(model_cfg, layout)
    for term in ("parameters", "gradients", "master_weights", "grad_accum_buffer", "optimizer_states"):
        assert measured[term] == planned.as_dict()[term], term  # static terms exactly
    predicted = planned.activations + planned.loss_logits
    assert predicted == pytest.approx(measured["activations_and_loss"], rel=0.10)


def test_recompute_modes_save_less_in_the_order_planned():
    model_cfg = ModelConfig(preset=None, **SMALL)
    sizes = {}
    for mode in ("none", "selective", "full"):
        layout = Layout(mbs=2, seq=64, recompute=mode, precision="fp32")
        sizes[mode] = measure(model_cfg, layout)["activations_and_loss"]
        planned = estimate_memory(model_cfg, layout)
        assert planned.activations + planned.loss_logits == pytest.approx(sizes[mode], rel=0.10)
    assert sizes["none"] > sizes["selective"] > sizes["full"]
