"""fp8 training (`training.precision fp8`): torchao's float8 linear layers, applied from outside the
model before tensor parallelism and FSDP2 wrap it (the order torchao requires).

Every `nn.Linear` of the transformer blocks (attention q/k/v/o, the SwiGLU's gate/up/down, a
mixture's shared experts) becomes torchao's `Float8Linear`: its three matmuls (output, input
gradient, weight gradient) take their operands cast to fp8 (e4m3) with a scale from each
operand's absolute maximum, per tensor (`training.fp8_scaling tensorwise`) or per row
(`rowwise`, scales rounded to powers of two). The output head and a mixture's router are not
converted: the head's logits and the router's scores are where a low-precision error is
amplified (a softmax over the vocabulary, a top-k over experts), so they keep running in bf16
through autocast like the rest of the model (norms, attention, the loss).

The weights stay fp32 parameters (the master weights); each forward casts them again, so a
checkpoint holds what a bf16 run's holds. Under FSDP2 with tensorwise scaling the weights are
all-gathered as fp8 (half the bytes of bf16): each shard is cast with a scale from the amax
over all shards. Tensor parallel uses the plan's own column- and row-parallel styles, which
all-gather and reduce-scatter activations in bf16; the matmuls on each rank's shard run in fp8.

On a CPU, and in tests, torchao emulates fp8 (`emulate`): operands are cast to fp8 and back,
with the same scales and rounding, and multiplied in bf16, which shows the numerics but not the
speed. On a GPU the fp8 matmuls need compute capability 8.9 (Ada, Hopper) or later; an older GPU
is refused with a ConfigError, as is a converted layer whose matmul dimensions on a rank are not
multiples of 16 (what the fp8 matmul kernels take)."""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from ultratron.errors import ConfigError
from ultratron.models.plan import ParallelPlan
from ultratron.parallel.dims import ParallelDims

FP8_MULTIPLE = 16  # torch._scaled_mm needs both dimensions of each fp8 operand to be multiples of 16
MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada Lovelace (8.9) and Hopper (9.0) onward


def apply_float8(model: nn.Module, dims: ParallelDims, plan: ParallelPlan, precision: str,
                 scaling: str, device: torch.device | None = None) -> nn.Module:
    """Under `precision` fp8, convert the blocks' linear layers to torchao's float8 training
    (`scaling`: tensorwise or rowwise); otherwise leave the model as it is."""
    if precision != "fp8":
        return model
    device = device if device is not None else next(model.parameters()).device  # where it will run
    emulate = device.type != "cuda"
    if not emulate:
        _check_capability(device)
    targets = float8_targets(model, plan)
    _check_dimensions(targets, dims.tp)
    Float8LinearConfig, convert_to_float8_training = _import_torchao()
    config = Float8LinearConfig.from_recipe_name(scaling)
    fsdp_fp8_gather = scaling == "tensorwise" and dims.uses_fsdp and dims.data_parallel > 1
    config = dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_fp8_gather)
    chosen = {id(module) for module in targets.values()}
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, _: id(module) in chosen)
    return model


def _import_torchao():
    """torchao's float8 training, imported without the warnings its import logs where its CUDA kernel
    libraries cannot load (on a CPU; the float8 training used here does not need them)."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
    return Float8LinearConfig, convert_to_float8_training


def float8_targets(model: nn.Module, plan: ParallelPlan) -> dict[str, nn.Linear]:
    """The linear layers fp8 converts, by name: those of the transformer blocks, less the routers
    of mixture-of-experts layers (the output head is outside the blocks)."""
    routers = {id(m) for moe in plan.moe_layers(model) for m in moe.router.modules()}
    in_blocks = {id(m) for block in plan.blocks(model).values() for m in block.modules()}
    return {name: module for name, module in model.named_modules()
            if type(module) is nn.Linear and id(module) in in_blocks and id(module) not in routers}


def _check_capability(device: torch.device) -> None:
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"training.precision = fp8: {name} (compute capability {capability[0]}.{capability[1]}) "
                          f"has no fp8 matmuls, which need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada, Hopper) "
                          "or later; use bf16")


def _check_dimensions(targets: dict[str, nn.Linear], tp: int) -> None:
    """Each converted layer's in and out features must split into tp rank shards that are
    multiples of 16 (tensor parallel cuts one or the other)."""
    multiple = FP8_MULTIPLE * tp
    where = f" ({FP8_MULTIPLE} × tp={tp})" if tp > 1 else ""
    problems = [f"training.precision = fp8: {name} is {layer.in_features} → {layer.out_features}, but fp8 "
                f"matmuls need both dimensions to be multiples of {multiple}{where}; use bf16 or another shape"
                for name, layer in targets.items()
                if layer.in_features % multiple or layer.out_features % multiple]
    if problems:
        raise ConfigError(problems)
