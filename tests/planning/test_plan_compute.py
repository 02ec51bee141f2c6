"""The compute term's efficiency by shape (`planning.compute`), against hand computations."""

import dataclasses
import math

import pytest

from ultratron.models.presets import PRESETS, ModelShape
from ultratron.planning.compute import (
    MATMUL_EFFICIENCY,
    MATMUL_OVERHEAD_S,
    attention_efficiency,
    compute_efficiency,
    layer_matmuls,
    matmul_seconds,
)
from ultratron.planning.flops import flops_per_token_of
from ultratron.planning.hardware import get_accelerator
from ultratron.planning.layout import Layout
from ultratron.planning.search import SearchSpec, estimate_step

H100 = get_accelerator("h100-sxm")
# the H100 SXM's dense bf16 peak, and the memory bandwidth its kernels reach: 0.92 of the datasheet's
# 3.35 TB/s (torchao's roofline model, planning.hardware)
PEAK, HBM = 989.4e12, 0.92 * 3.35e12


def test_a_matmul_is_its_main_loop_and_store_or_its_operands_streamed():
    assert H100.hbm_bw == pytest.approx(HBM)
    # 1.1 TFLOP at 0.61 of the peak (1.82 ms), then the 134 MB output stored (44 µs)
    big = matmul_seconds(8192, 8192, 8192, PEAK, HBM, 2)
    assert big == pytest.approx(2 * 8192**3 / (0.61 * PEAK) + 2 * 8192 * 8192 / HBM + 5e-6)
    # a short K: 34 GFLOP (57 µs) and the same 134 MB stored (44 µs): the store is 43 % of it
    short = matmul_seconds(8192, 256, 8192, PEAK, HBM, 2)
    assert short == pytest.approx(2 * 8192 * 256 * 8192 / (0.61 * PEAK) + 2 * 8192 * 8192 / HBM + 5e-6)
    thin = matmul_seconds(256, 8192, 128, PEAK, HBM, 2)  # 0.5 GFLOP moving 4.5 MB: memory-bound
    assert thin == pytest.approx(2 * (256 * 8192 + 8192 * 128 + 256 * 128) / HBM + 5e-6)
    assert MATMUL_EFFICIENCY == 0.61 and MATMUL_OVERHEAD_S == 5e-6


def test_attention_efficiency_interpolates_the_measured_table_in_log_seq():
    assert attention_efficiency(4096) == pytest.approx(0.631)
    assert attention_efficiency(100) == pytest.approx(0.023) and attention_efficiency(1e6) == pytest.approx(0.999)
    # halfway between 4096 and 8192 in log: the mean of their efficiencies
    assert attention_efficiency(4096 * math.sqrt(2)) == pytest.approx((0.631 + 0.908) / 2)


def test_compute_efficiency_of_a_small_model_by_hand():
    shape = ModelShape(n_layers=2, dim=1024, n_heads=8, n_kv_heads=2, ffn_dim=4096, vocab_size=32000,
                       tie_embeddings=False, rope_theta=1e4, max_seq_len=2048)
    lay = Layout(tp=2, micro_batch_size=2, seq_len=2048)
    tokens, q, kv = 4096, 1024, 256
    # the model's linear layers, split by tp: wq; wk and wv; wo; w1 and w3; w2
    products = [(tokens, 1024, q / 2), (tokens, 1024, kv / 2), (tokens, 1024, kv / 2), (tokens, q / 2, 1024),
                (tokens, 1024, 2048), (tokens, 1024, 2048), (tokens, 2048, 1024)]
    assert sorted(p[:3] for p in layer_matmuls(shape, tokens, 2) for _ in range(int(p[3]))) == sorted(products)
    flops = seconds = 0.0
    for m, k, n in [*products, *products, (tokens, 1024, 16000)]:  # 2 layers, then the head
        flops += 6 * m * k * n
        seconds += 3 * matmul_seconds(m, k, n, PEAK, HBM, 2)
    attention = 12 * 2 * 1024 * 2048 * tokens / 2
    flops += attention
    seconds += attention / (attention_efficiency(2048) * PEAK)
    assert compute_efficiency(shape, lay, PEAK, HBM) == pytest.approx(flops / seconds / PEAK)


def test_small_per_rank_matmuls_run_slower_and_the_step_uses_it():
    shape = PRESETS["llama3-70b"]
    wide = compute_efficiency(shape, Layout(tp=1, micro_batch_size=1, seq_len=8192), PEAK, HBM)
    split = compute_efficiency(shape, Layout(tp=32, micro_batch_size=1, seq_len=1024), PEAK, HBM)
    # attention at seq 8192 runs above the products; 1024 tokens × 320-wide products: launch and bytes show
    assert 0.58 < wide < 0.65 and split < 0.8 * wide
    spec = SearchSpec(PRESETS["llama3-8b"], H100, 8, 8, 8 * 4 * 4096, 4096)
    lay = Layout(dp=8, micro_batch_size=2, grad_accum=2, seq_len=4096)
    est = estimate_step(spec, lay)
    eff = compute_efficiency(spec.shape, lay, PEAK, HBM)
    assert est.efficiency == pytest.approx(eff)
    assert est.compute_s == pytest.approx(spec.global_batch_tokens * flops_per_token_of(spec.shape, 4096)
                                          / (8 * PEAK * eff))


def test_elementwise_and_optimizer_bytes_by_hand():
    from ultratron.planning.compute import elementwise_bytes
    from ultratron.planning.memory import estimate_memory

    shape = ModelShape(n_layers=2, dim=1024, n_heads=8, n_kv_heads=2, ffn_dim=4096, vocab_size=32000,
                       tie_embeddings=False, rope_theta=1e4, max_seq_len=2048)
    # tp2 + sp under bf16 runs as FSDP2 would not here (no dp): autocast over an fp32 stream, r = 4, p = 2
    lay = Layout(tp=2, sp=True, micro_batch_size=2, seq_len=2048, grad_accum=4, precision="bf16")
    mem = estimate_memory(shape, lay)
    tokens, h, hs, q, kv, f = 4096, 1024, 1024 / 2, 1024 / 2, 256 / 2, 4096 / 2  # sp: norms and residuals on h/t
    norms = 2 * hs * 28 + 2 * hs * 92  # an fp32 stream: no up- or downcast
    residual = 2 * (2 * 4 + 2) * hs + 2 * 3 * 4 * hs + 2 * (4 + 2) * hs
    rotary = (q + kv) * (8 + 12) + (q + kv) * (10 + 12)  # bf16 q and k
    swiglu = 5 * 2 * f + 9 * 2 * f
    casts = 2 * 6 * h / 2 * 2 + 3 * 3 * 4 * h  # two shard casts each way; three fp32 input-gradient sums
    weights = (2 * 1024 * 1024 + 2 * 1024 * 256 + 3 * 1024 * 4096) / 2 * 6 * 2  # autocast's weight copies
    micro, optimizer = elementwise_bytes(shape, lay, mem)
    per_token = norms + residual + rotary + swiglu + casts
    # 2 layers, + 6 fp32 passes of the V/t logits
    assert micro == pytest.approx(tokens * 2 * per_token + 2 * weights + tokens * 6 * 4 * 32000 / 2)
    # the states read once and written once but the gradients, which 3 further micro-batches read and write
    assert optimizer == pytest.approx(2 * mem.static_bytes - mem.gradients + 2 * 3 * mem.gradients)
    # selective recompute runs the norms, rotary, SwiGLU and casts' forward again, full the whole forward
    # (and autocast's weight copies once more under either)
    selective, _ = elementwise_bytes(shape, dataclasses.replace(lay, recompute="selective"), mem)
    full, _ = elementwise_bytes(shape, dataclasses.replace(lay, recompute="full"), mem)
    again = 2 * hs * 28 + (q + kv) * 20 + 5 * 2 * f + 2 * 6 * h / 2
    assert selective - micro == pytest.approx(tokens * 2 * again + weights)
    assert full - micro == pytest.approx(tokens * 2 * (again + 2 * (2 * 4 + 2) * hs) + weights)


# Every aten op of a block's forward and backward that is not a matmul, attention or a view, with the
# bytes it reads and writes: what the elementwise term has to count (tensors broadcast by stride 0
# count once).
_NOT_TRAFFIC = {"view", "_unsafe_view", "expand", "t", "transpose", "unsqueeze", "squeeze", "slice", "select",
                "as_strided", "view_as_real", "view_as_complex", "detach", "alias", "permute", "reshape",
                "split", "unbind", "lift_fresh", "empty", "empty_strided", "mm", "addmm", "bmm"}


def _block_traffic(mode: str, batch: int, dim=64, heads=4, kv_heads=2, ffn=192, seq=32) -> tuple[float, float]:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from ultratron.models.llama.model import LlamaArgs, TransformerBlock, rope_tables

    def size(t):
        return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())

    class Traffic(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name not in _NOT_TRAFFIC and "attention" not in name:
                tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
                self.total += sum(size(t) for t in tensors)
            return out

    torch.manual_seed(0)
    block = TransformerBlock(LlamaArgs(n_layers=1, dim=dim, n_heads=heads, n_kv_heads=kv_heads, ffn_dim=ffn,
                                       vocab_size=128, max_seq_len=seq))
    if mode == "bf16 weights":  # FSDP2's mixed precision: the block runs in bf16
        block = block.to(torch.bfloat16)
    x = torch.randn(batch, seq, dim, dtype=next(block.parameters()).dtype, requires_grad=True)
    cos, sin = rope_tables(dim // heads, seq, 1e4)
    forward, backward = Traffic(), Traffic()
    with forward, torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        y = block(x, cos, sin)
    grad = torch.randn_like(y)
    with backward:
        y.backward(grad)
    return forward.total, backward.total


@pytest.mark.parametrize("mode,layout", [
    ("fp32", Layout(precision="fp32")),
    ("bf16 weights", Layout(dp=2, zero=3, precision="bf16", attention_fp32=True)),
    ("autocast", Layout(precision="bf16", attention_fp32=True)),
])
def test_the_elementwise_bytes_are_the_trainers_own_kernels(mode, layout):
    """A block's non-matmul kernels, counted op by op as torch dispatches them (on CPU, where bf16
    attention runs in fp32: `attention_fp32`), per token: the difference between 2 and 4 sequences
    leaves out what is paid once per call (autocast's weight copies, the norm weights' casts and
    gradients, RoPE's tables). Equal to `layer_elementwise_bytes` within 2% (what it leaves out:
    RoPE's tables per token, a few per-row rsqrt and sum kernels)."""
    from ultratron.planning.compute import layer_elementwise_bytes

    shape = ModelShape(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=128,
                       tie_embeddings=False, rope_theta=1e4, max_seq_len=32)
    (f2, b2), (f4, b4) = _block_traffic(mode, 2), _block_traffic(mode, 4)
    per_token = {"forward": (f4 - f2) / 64, "backward": (b4 - b2) / 64}
    planned = layer_elementwise_bytes(shape, dataclasses.replace(layout, seq_len=32))
    assert sum(f for f, _ in planned.values()) == pytest.approx(per_token["forward"], rel=0.02)
    assert sum(b for _, b in planned.values()) == pytest.approx(per_token["backward"], rel=0.02)


def test_compiled_blocks_and_loss_by_hand():
    from ultratron.planning.compute import elementwise_parts
    from ultratron.planning.memory import estimate_memory

    shape = ModelShape(n_layers=2, dim=1024, n_heads=8, n_kv_heads=2, ffn_dim=4096, vocab_size=32000,
                       tie_embeddings=False, rope_theta=1e4, max_seq_len=2048)
    lay = Layout(dp=2, zero=3, micro_batch_size=2, seq_len=2048, precision="bf16", compile=True)  # r = p = 2
    mem = estimate_memory(shape, lay)
    tokens, h, q, kv, f = 4096, 1024, 1024, 256, 4096
    forward = (4 * 2 + 5 * 2) * h + 2 * 2 * (q + kv) + 3 * 2 * f
    backward = (9 * 2 + 10 * 2) * h + 2 * 2 * (q + kv) + 5 * 2 * f
    parts = elementwise_parts(shape, lay, mem)
    assert parts["layer"][0] == pytest.approx(tokens * 2 * (forward + backward))
    assert parts["loss"][0] == pytest.approx(tokens * 4 * 2 * 32000)  # 4 passes over bf16 logits
    # selective recompute runs the fused norms, rotary and SwiGLU forward again
    again = elementwise_parts(shape, dataclasses.replace(lay, recompute="selective"), mem)
    assert again["layer"][0] - parts["layer"][0] == pytest.approx(tokens * 2 * forward)
    eager = elementwise_parts(shape, dataclasses.replace(lay, compile=False), mem)
    assert eager["loss"][0] == pytest.approx(tokens * 6 * 4 * 32000) and eager["layer"][0] > 2 * parts["layer"][0]
    # under tp the logits are vocab-sharded and the loss runs eagerly (`compiled_loss`)
    tp = dataclasses.replace(lay, dp=1, zero=0, tp=2, sp=True)
    assert elementwise_parts(shape, tp, estimate_memory(shape, tp))["loss"][0] == pytest.approx(tokens * 6 * 4 * 16000)


def test_fp8_casts_by_hand():
    """Under fp8 each block linear's input (forward) and output gradient (backward) is cast to fp8 in
    both layouts — eager 2p + 3 bytes an element, compiled p + 2 — and each micro-batch casts the fp32
    weights, 14 bytes an element (under ZeRO-3 on the shard, plus 2 for the gathered weight's copy)."""
    from ultratron.planning.activations import layer_matmul_params
    from ultratron.planning.compute import elementwise_parts, layer_elementwise_bytes
    from ultratron.planning.memory import estimate_memory

    shape = ModelShape(n_layers=2, dim=1024, n_heads=8, n_kv_heads=2, ffn_dim=4096, vocab_size=32000,
                       tie_embeddings=False, rope_theta=1e4, max_seq_len=2048)
    lay = Layout(tp=2, sp=True, micro_batch_size=2, seq_len=2048, precision="fp8")
    h, q, kv, f = 1024, 1024 / 2, 256 / 2, 4096 / 2
    inputs, grad_outputs = 3 * h + q + 2 * h + f, q + 2 * kv + h + 2 * f + h
    assert layer_elementwise_bytes(shape, lay)["fp8 casts"] == pytest.approx((7 * inputs, 7 * grad_outputs))
    compiled = dataclasses.replace(lay, compile=True)
    assert layer_elementwise_bytes(shape, compiled)["fp8 casts"] == pytest.approx((4 * inputs, 4 * grad_outputs))
    assert "fp8 casts" not in layer_elementwise_bytes(shape, dataclasses.replace(lay, precision="bf16"))
    # the weights: 14 bytes an element per micro-batch (not autocast's 6 + 6); ZeRO-3 over 4: 14/4 + 2
    weights = 2 * layer_matmul_params(shape, 2)
    tokens = 4096
    per_token = sum(a + b for a, b in layer_elementwise_bytes(shape, lay).values())
    parts = elementwise_parts(shape, lay, estimate_memory(shape, lay))
    assert parts["layer"][0] == pytest.approx(tokens * 2 * per_token + 14 * weights)
    sharded = dataclasses.replace(lay, dp=4, zero=3)
    per_token = sum(a + b for a, b in layer_elementwise_bytes(shape, sharded).values())
    parts = elementwise_parts(shape, sharded, estimate_memory(shape, sharded))
    assert parts["layer"][0] == pytest.approx(tokens * 2 * per_token + (14 / 4 + 2) * weights)


def _compiled_block_traffic(dtype, batch=8, dim=64, heads=4, kv_heads=2, ffn=192, seq=32) -> list[float]:
    """Bytes Inductor's own count gives the kernels it generates for a compiled block (the fused
    loops; not the matmuls and attention it calls), per compiled graph: [forward, backward]."""
    from unittest import mock

    import torch
    import torch._inductor.config as inductor_config
    from torch._inductor.graph import GraphLowering
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

    from ultratron.models.llama.model import LlamaArgs, TransformerBlock, rope_tables

    graphs, codegen = [], GraphLowering.codegen

    def counting_codegen(self, *args, **kwargs):
        out = codegen(self, *args, **kwargs)
        graphs.append(sum(node.get_read_write_buffers_sizes() for node in self.scheduler.nodes
                          if not isinstance(node, ExternKernelSchedulerNode | NopKernelSchedulerNode)))
        return out

    torch._dynamo.reset()
    torch.manual_seed(0)
    block = TransformerBlock(LlamaArgs(n_layers=1, dim=dim, n_heads=heads, n_kv_heads=kv_heads, ffn_dim=ffn,
                                       vocab_size=128, max_seq_len=seq)).to(dtype)
    x = torch.randn(batch, seq, dim, dtype=dtype, requires_grad=True)
    cos, sin = rope_tables(dim // heads, seq, 1e4)
    with mock.patch.object(GraphLowering, "codegen", counting_codegen), \
            inductor_config.patch(force_disable_caches=True):
        y = torch.compile(block, fullgraph=True)(x, cos, sin)
        y.backward(torch.randn_like(y))
    torch._dynamo.reset()
    return graphs


# the caches are off so that Inductor generates (and counts) its kernels on every run; torch says so
@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled:UserWarning")
@pytest.mark.parametrize("dtype,layout", [
    ("float32", Layout(precision="fp32", compile=True)),
    ("bfloat16", Layout(dp=2, zero=3, precision="bf16", attention_fp32=True, compile=True)),
])
def test_the_compiled_bytes_are_inductors_own_count(dtype, layout):
    """A compiled block's fused kernels, as Inductor counts their reads and writes, per token (256
    tokens: RoPE's tables and the norms' weights, paid once per call, are under 1%), against
    `layer_elementwise_bytes` under compile. Within 2%: the count is 0.1-1% above the model in fp32
    and in bf16 (on a CPU, where attention runs in fp32), forward and backward; what the model
    leaves out is a few per-row values (the norms' rsqrt, a weight gradient's partial sums)."""
    import torch

    from ultratron.planning.compute import layer_elementwise_bytes

    shape = ModelShape(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=128,
                       tie_embeddings=False, rope_theta=1e4, max_seq_len=32)
    forward, backward = (b / 256 for b in _compiled_block_traffic(getattr(torch, dtype)))
    planned = layer_elementwise_bytes(shape, dataclasses.replace(layout, seq_len=32))
    assert sum(f for f, _ in planned.values()) == pytest.approx(forward, rel=0.02)
    assert sum(b for _, b in planned.values()) == pytest.approx(backward, rel=0.02)


def test_the_step_prices_elementwise_work_at_memory_bandwidth():
    from ultratron.planning.compute import elementwise_bytes

    shape = PRESETS["llama3-8b"]
    lay = Layout(dp=8, zero=3, micro_batch_size=2, grad_accum=2, seq_len=8192)
    spec = SearchSpec(shape, H100, 8, 8, 8 * 2 * 2 * 8192, 8192)
    est = estimate_step(spec, lay)
    micro, optimizer = elementwise_bytes(shape, lay, est.memory)
    assert est.elementwise_s == pytest.approx(2 * micro / HBM) and est.optimizer_s == pytest.approx(optimizer / HBM)
    # half the bandwidth: twice the elementwise time
    half = dataclasses.replace(H100, memory_bw=H100.memory_bw / 2)
    slow = estimate_step(dataclasses.replace(spec, accelerator=half), lay)
    assert slow.elementwise_s == pytest.approx(2 * est.elementwise_s)
    assert slow.step_s > est.step_s and 0.05 < est.elementwise_s / est.compute_s < 0.3  # a 4k-wide model: ~1/10


def test_ranks_sharing_cores_compute_slower_and_hide_no_communication():
    cpu = dataclasses.replace(H100, name="cpu", cores=2, threads_per_rank=1, comm_uses_cores=True,
                              attention_table=False)
    assert cpu.core_share(4) == 2.0 and cpu.core_share(1) == 1.0 and H100.core_share(8) == 1.0
    assert dataclasses.replace(cpu, threads_per_rank=2).core_share(4) == 4.0
    shape = PRESETS["tiny"]
    lay = Layout(dp=4, zero=3, seq_len=256, micro_batch_size=8)  # FSDP: gathers an overlap could hide
    shared = estimate_step(SearchSpec(shape, cpu, 4, 4, 4 * 8 * 256, 256), lay)
    own = estimate_step(SearchSpec(shape, dataclasses.replace(cpu, cores=0, comm_uses_cores=False), 4, 4,
                                   4 * 8 * 256, 256), lay)
    assert shared.core_share == 2.0 and own.core_share == 1.0
    assert shared.compute_s == pytest.approx(2 * own.compute_s)
    assert shared.elementwise_s == pytest.approx(2 * own.elementwise_s)
    assert shared.optimizer_s == pytest.approx(2 * own.optimizer_s)
    # gloo's threads run on the compute's cores: every collective is on the critical path
    assert shared.exposed == pytest.approx([c.seconds for c in shared.collectives])
    assert sum(own.exposed) < sum(c.seconds for c in own.collectives)
    # four ranks on two nodes of two: each node's two ranks fit its two cores
    assert estimate_step(SearchSpec(shape, cpu, 4, 2, 4 * 8 * 256, 256), lay).core_share == 1.0


def test_attention_flops_count_heads_times_head_dim_not_the_width():
    """PaLM's 12·L·H·Q·T (Chowdhery et al. 2022, appendix B): Qwen3-30B-A3B's 32 heads of 128 over a
    width of 2,048 attend over 4,096 channels; Llama's shapes make the two equal."""
    qwen = PRESETS["qwen3-30b-a3b"]
    width = qwen.n_heads * qwen.head_dim
    assert width == 2 * qwen.dim
    attention = flops_per_token_of(qwen, 8192) - flops_per_token_of(qwen, 4096)
    assert attention == pytest.approx(12 * qwen.n_layers * width * 4096)
    llama = PRESETS["llama3-8b"]
    assert flops_per_token_of(llama, 8192) - flops_per_token_of(llama, 4096) == 12 * 32 * 4096 * 4096


def test_measured_kernels_price_each_kind_by_calls_latency_and_bandwidth():
    # a profile's kernels (bench comm): each kind at its own bytes/s plus seconds per call, attention
    # at its measured FLOP/s; by hand from the byte counts of `test_elementwise_and_optimizer_bytes_by_hand`
    from ultratron.planning.compute import elementwise_parts

    shape = PRESETS["tiny"]  # 4 layers, h 256, 8 heads and 4 kv heads of 32, f 768, V 4096
    lay = Layout(dp=1, micro_batch_size=8, seq_len=256, grad_accum=2, precision="fp32", recompute="full")
    kernels = {"layer": (3e9, 2e-3), "loss": (1e9, 1e-3), "optimizer": (5e9, 0.0)}
    cpu = dataclasses.replace(H100, name="cpu", flops={"fp32": 60e9}, memory_bw=12e9, memory_achieved=1.0,
                              attention_table=False, kernels=kernels, attention_flops=20e9)
    spec = SearchSpec(shape, cpu, 1, 1, 2 * 8 * 256, 256, "fp32", efficiency=1.0)
    est = estimate_step(spec, lay)
    # fp32, per token and layer (`layer_elementwise_bytes`): norms, residuals, rotary, SwiGLU (+ input-gradient sums)
    tokens = 2048
    forward = 2 * 256 * 28 + 2 * 12 * 256 + 384 * 8 + 5 * 4 * 768
    backward = 2 * 256 * 92 + 2 * 12 * 256 + 384 * 10 + 9 * 4 * 768 + 3 * 3 * 4 * 256
    layer_bytes = tokens * 4 * (forward + backward + forward)  # 4 layers; full recompute runs the forward again
    parts = elementwise_parts(shape, lay, est.memory)
    # recompute repeats the forward's share of a call
    assert parts["layer"] == pytest.approx((layer_bytes, 4 * (2 * forward + backward) / (forward + backward)))
    assert parts["loss"] == pytest.approx((tokens * 6 * 4 * 4096, 1.0))
    per_micro = parts["layer"][1] * 2e-3 + layer_bytes / 3e9 + 1e-3 + tokens * 6 * 4 * 4096 / 1e9
    assert est.elementwise_s == pytest.approx(2 * per_micro)  # two micro-batches
    assert est.optimizer_s == pytest.approx(parts["optimizer"][0] / 5e9)
    # attention at its measured rate, the products at the matmul rate (efficiency 1)
    eff = compute_efficiency(shape, lay, 60e9, 12e9, 1.0, False, attention_flops=20e9)
    attention = 12 * 4 * 256 * 256 * tokens
    products = sum(3 * matmul_seconds(m, k, n, 60e9, 12e9, 4, 1.0) * c * 4 for m, k, n, c in
                   layer_matmuls(shape, tokens, 1)) + 3 * matmul_seconds(tokens, 256, 4096, 60e9, 12e9, 4, 1.0)
    assert eff == pytest.approx(est.efficiency)  # the step uses the same function
    flops = sum(6 * m * k * n * c * 4 for m, k, n, c in layer_matmuls(shape, tokens, 1)) + 6 * tokens * 256 * 4096
    assert eff == pytest.approx((flops + attention) / (products + attention / 20e9) / 60e9)
    # a kind the profile did not measure stays at the memory bandwidth, without latency
    plain = estimate_step(dataclasses.replace(spec, accelerator=dataclasses.replace(cpu, kernels={})), lay)
    assert plain.elementwise_s == pytest.approx(2 * (layer_bytes + tokens * 6 * 4 * 4096) / 12e9)
