"""fp32 linear layers on a CPU through oneDNN's matmul, the weight gradient through MKL's (`training.cpu_linear`).

torch computes an fp32 `F.linear` on a CPU with MKL's sgemm. On AMD CPUs MKL runs its AVX2 code,
not AVX-512; oneDNN (which torch ships, and uses itself for bf16 matmuls) runs AVX-512 on both
vendors. Measured on this project's 2-core AMD EPYC machine, (2048 × 384) inputs, GFLOP/s MKL →
oneDNN: forward 140–190 → 250–410, input gradient 180–190 → 370–440, weight gradient 180 → 290–320
(the vocabulary head's, 4096 wide, 177 → 169: no gain there). Both accumulate in fp32: the results
differ from MKL's by the rounding of a different summation order (relative 1e-6).

The weight gradient, grad.T @ x, contracts over the tokens, the leading dimension of both
operands. MKL's sgemm reads them transposed in place; oneDNN's linear wants the contracted
dimension last in both, so it needed a copy of each activation first. On a later day of the same
machine (MKL's forward at 178, oneDNN's at 205 GFLOP/s), those copies made oneDNN's weight
gradient slower than MKL's (147–173 vs 157–185; the head's 106 vs 169), and the compiled fp32
step ran 4–14 % faster with MKL's (the two interleaved in one process, four comparisons of 8–16
steps each); an earlier day saw no difference. So the weight gradient is MKL's; the forward and
the input gradient stay oneDNN's.

`apply_cpu_linear` replaces each bias-free `nn.Linear` of a CPU model by a `OneDNNLinear` holding
the same Parameter (tied weights stay tied; state-dict names are unchanged), whose forward calls
the custom op `ultratron::linear` (forward and input gradient one oneDNN matmul each, the weight
gradient one MKL sgemm) when the step computes in fp32 on plain tensors, and `F.linear` otherwise
— under bf16 autocast (torch already uses oneDNN for bf16), on DTensors (tensor parallel; FSDP2
hands the layer its gathered weight as a plain tensor, so ZeRO keeps the fast path), in other
dtypes. Selective recompute saves the op's output as it saves aten's matmuls
(`parallel/recompute.py`); torch.compile keeps it as one opaque call.

Opt-in (`training.cpu_linear = onednn`; the default `aten` is torch's own kernel): it swaps a
custom op into every linear layer for a gain that depends on the CPU (AMD's, where MKL runs AVX2;
little on Intel's) and on the day (1.0–1.2× the step, docs/performance.md), so the general path
keeps torch's kernel. When asked for, a probe first checks that it works here and agrees with
`F.linear` (values and both gradients within 1e-5 relative), and an error says why it cannot run.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ultratron.errors import ConfigError


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T in oneDNN (any leading dimensions on a; b 2-D, any strides)."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


@torch.library.custom_op("ultratron::linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T, as F.linear without a bias."""
    return _matmul(x, weight)


@onednn_linear.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("ultratron::linear_weight_grad", mutates_args=())
def _weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad.T @ x over all leading dimensions: the weight's gradient, (out, in), in MKL's sgemm,
    which reads the transposed gradient in place (see the module docstring for why not oneDNN)."""
    return torch.mm(grad.reshape(-1, grad.shape[-1]).t(), x.reshape(-1, x.shape[-1]))


@_weight_grad.register_fake
def _(grad, x):
    return grad.new_empty(grad.shape[-1], x.shape[-1])


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x = onednn_linear(grad, weight.t()) if ctx.needs_input_grad[0] else None
    grad_w = _weight_grad(grad, x) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w


onednn_linear.register_autograd(_backward, setup_context=_setup)


class OneDNNLinear(nn.Linear):
    """`nn.Linear` whose fp32 forward and backward run on oneDNN (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (self.bias is None and x.dtype == torch.float32 and w.dtype == torch.float32
                and not isinstance(w, DTensor) and not isinstance(x, DTensor)
                and not torch.is_autocast_enabled("cpu")):
            return onednn_linear(x, w)
        return F.linear(x, w, self.bias)


@functools.cache
def probe() -> str | None:
    """None if oneDNN's linear works here and agrees with F.linear; else why not. Once per process."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN (mkldnn)"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 96, generator=generator, requires_grad=True)
    w = torch.randn(72, 96, generator=generator, requires_grad=True)
    g = torch.randn(3, 40, 72, generator=generator)
    try:
        ours = onednn_linear(x, w)
        ours_grads = torch.autograd.grad(ours, (x, w), g)
    except RuntimeError as err:
        return f"oneDNN's linear failed: {err}"
    ref = F.linear(x, w)
    ref_grads = torch.autograd.grad(ref, (x, w), g)
    for name, a, b in zip(("output", "input gradient", "weight gradient"), (ours, *ours_grads), (ref, *ref_grads),
                          strict=True):
        a, b = a.detach(), b.detach()
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max())):
            return f"oneDNN's linear disagrees with F.linear in its {name}"
    return None


def apply_cpu_linear(model: nn.Module, mode: str, tp: int, device: torch.device | None = None) -> nn.Module:
    """With `mode` onednn, the bias-free `nn.Linear` layers of a CPU model become `OneDNNLinear`
    (a ConfigError says why where they cannot); with aten the model is left as it is."""
    if mode == "aten":
        return model
    if (device if device is not None else next(model.parameters()).device).type != "cpu":
        problem = "the model is not on a CPU"
    elif tp > 1:
        problem = "tensor parallel runs its linear layers on DTensors"
    else:
        problem = probe()
    if problem is not None:
        raise ConfigError([f"training.cpu_linear = onednn: {problem}; use aten (torch's own kernel)"])
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.bias is None:
                setattr(parent, name, _onednn_twin(child))
    return model


def _onednn_twin(linear: nn.Linear) -> OneDNNLinear:
    """A `OneDNNLinear` holding `linear`'s own weight (the same Parameter: a tied weight stays tied,
    and the state-dict names are the same)."""
    twin = OneDNNLinear(linear.in_features, linear.out_features, bias=False, device="meta")
    twin.weight = linear.weight
    return twin
