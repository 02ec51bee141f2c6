"""Tensor parallelism with DTensor's `parallelize_module`, on the plan the model family provides
(`models/*/parallel_plan.py` says which layers are column- or row-parallel).

The cross-entropy runs under `loss_parallel` on vocab-sharded logits, so the full (tokens × vocab)
logits never exist on one rank: in training and in validation (the step's loss in eval mode). Any
other forward in eval mode returns full logits (sampling and evaluation read them like in one process).

LoRA's adapters (`models/lora.py`) are split as their base layer is, so that B A x comes out in the
layout W x does: a column-parallel layer (its output features split) splits B (out × rank) along
its rows and keeps A whole; a row-parallel one (its input features split) splits A (rank × in)
along its columns and keeps B whole, and B A x is then a partial sum like W x, which the layer's
own reduction (all-reduce, or reduce-scatter under sequence parallel) sums with it: the adapter's
hook runs before the one `parallelize_module` adds.

Under sequence parallelism a column-parallel layer's input (and a mixture of experts' layer's, whose
router and experts take every token) is all-gathered along the sequence, and autograd would keep the
gathered (whole-sequence) tensor for the weight gradient. `KeepSequenceShard` does the gather instead
and keeps only this rank's shard for backward, which all-gathers it again (Korthikanti et al. 2022
§4.2.2, as Megatron-LM does): every tensor a dense block saves is then 1/tp (a MoE layer's routed
slots stay whole: docs/parallel.md). docs/parallel.md says why saved-tensor hooks and not a
checkpoint policy or torch's `input_reshard`.

In a step (`TensorAxis`): the training and validation loss under `loss_parallel`; tp ranks hold the
same tokens, so nothing is averaged over them; under sequence parallelism sampling pads its context
to a multiple of tp (the activations between blocks are split along the sequence). A weight kept whole on
every tp rank but applied to a rank's share of the work (the norms under sequence parallelism, LoRA's
unsplit adapter factors) gets its gradient as a partial sum (DTensor's `Partial`); after backward
these are summed over the tp ranks in one all-reduce (as Megatron-LM all-reduces its
sequence-parallel norm gradients), since DTensor would otherwise sum a `Partial` operand again in
every optimizer op that reads it. Under FSDP2 the data axis' reduction already leaves them whole.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from ultratron.models.lora import ADAPTERS
from ultratron.models.plan import ParallelPlan
from ultratron.parallel.axis import Axis
from ultratron.parallel.dims import ParallelDims

# each adapter's dim of W's size: A (rank × in) has W's input features (dim 1), B (out × rank) its outputs (dim 0)
_WEIGHT_DIM = {"lora_a": 1, "lora_b": 0}


def _parallelize_keeping_adapters(module: nn.Module, mesh, styles: dict) -> None:
    """`parallelize_module`, with the LoRA adapters of its linear layers split along the dim their
    layer's weight is split along (module docstring). They are set aside meanwhile: a column-parallel
    style would split every parameter of its layer along dim 0, A's rank too. A frozen parameter
    (LoRA's base model) stays frozen."""
    adapted = {layer: {name: layer._parameters.pop(name) for name in ADAPTERS}
               for layer in module.modules() if ADAPTERS[0] in layer._parameters}
    frozen = {name for name, param in module.named_parameters() if not param.requires_grad}
    parallelize_module(module, mesh, styles)
    for name, param in module.named_parameters():  # SequenceParallel makes its norms' weights trainable
        param.requires_grad_(name not in frozen)
    for layer, adapters in adapted.items():
        split = layer.weight.placements[0] if isinstance(layer.weight, DTensor) else None
        for name, param in adapters.items():
            if split is not None:  # a layer tp leaves whole keeps whole adapters
                place = Shard(_WEIGHT_DIM[name]) if split == Shard(_WEIGHT_DIM[name]) else Replicate()
                param = nn.Parameter(distribute_tensor(param.detach(), mesh, [place], src_data_rank=None),
                                     requires_grad=param.requires_grad)
            layer.register_parameter(name, param)


class _SavedShard:
    """One gather's saved-tensor hooks: a saved view of the gathered tensor is packed as the shard it
    was gathered from; the first unpack in backward gathers it again, and the last one lets it go."""

    def __init__(self, shard: DTensor, gathered: DTensor):
        self.shard = shard.detach()
        self.storage = gathered.to_local().untyped_storage()._cdata  # an id: the gathered tensor is not kept
        self.pending = 0
        self.gathered: torch.Tensor | None = None

    def pack(self, tensor: torch.Tensor):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.untyped_storage()._cdata != self.storage:
            # detached: a saved output holding its own grad_fn would make a cycle autograd never frees
            return tensor.detach()
        self.pending += 1
        spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride()) if tensor is not local else None
        return spec, local.size(), local.stride(), local.storage_offset()

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        spec, size, stride, offset = packed
        if self.gathered is None:
            self.gathered = self.shard.redistribute(self.shard.device_mesh, (Replicate(),)).to_local()
        local = self.gathered.as_strided(size, stride, offset)
        self.pending -= 1
        if self.pending <= 0:
            self.gathered = None
        if spec is None:
            return local
        mesh, placements, shape, global_stride = spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=global_stride)


def _can_hook_saved_tensors() -> bool:
    """Not under recomputation (a checkpoint's own hooks decide what is kept), compile or no_grad."""
    return (torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and torch._C._autograd._saved_tensors_hooks_is_enabled()
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None)


def _in_autocast_dtype(shard: DTensor) -> DTensor:
    """Under autocast, the shard cast to the dtype the module's matmuls would cast the gathered
    tensor to: the same values, gathered at half the bytes, and a tensor the matmuls keep as it is
    (each would keep its own whole-sequence cast otherwise)."""
    device = shard.device.type
    if not (torch.is_autocast_enabled(device) and shard.is_floating_point()):
        return shard
    dtype = torch.get_autocast_dtype(device)
    return shard.to(dtype) if shard.element_size() > torch.finfo(dtype).bits // 8 else shard


class KeepSequenceShard(ParallelStyle):
    """Before the module: all-gather its first input from sequence shards (`Shard(1)`, a DTensor or
    this rank's local part) into a replicated DTensor (its local tensor with `use_local_output`);
    while it runs, what autograd saves of the gathered tensor is kept as the shard (`_SavedShard`)."""

    def __init__(self, use_local_output: bool = False):
        super().__init__()
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        stack: list = []

        def gather(module, args):
            shard = args[0]
            if not isinstance(shard, DTensor):
                shard = DTensor.from_local(shard, device_mesh, (Shard(1),), run_check=False)
            shard = _in_autocast_dtype(shard)
            gathered = shard.redistribute(device_mesh, (Replicate(),))
            hooks = None
            if shard.placements != gathered.placements and _can_hook_saved_tensors():
                saved = _SavedShard(shard, gathered)
                hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack)
                hooks.__enter__()
            stack.append(hooks)
            return (gathered.to_local() if self.use_local_output else gathered, *args[1:])

        def release(module, args, output):
            hooks = stack.pop()
            if hooks is not None:
                hooks.__exit__(None, None, None)

        module.register_forward_pre_hook(gather, prepend=True)
        module.register_forward_hook(release, always_call=True)
        return module


def _gathers_sequence(layouts, desired) -> bool:
    return bool(layouts) and layouts[0] == Shard(1) and desired[0] == Replicate() and not any(layouts[1:])


def _keep_shards(plan: dict) -> tuple[dict, dict[str, KeepSequenceShard]]:
    """`plan` with each sequence all-gather before a module done by `KeepSequenceShard`: a
    `PrepareModuleInput` that gathers is replaced; a `PrepareModuleInputOutput` that gathers (a
    mixture of experts' layer) keeps its output half; a `ColwiseParallel` that gathers takes the
    gathered input instead. The last two's modules get their `KeepSequenceShard` afterwards (the
    returned dict)."""
    leaner, later = {}, {}
    for name, style in plan.items():
        inputs = style.prepare_module_input if isinstance(style, PrepareModuleInputOutput) else style
        if (isinstance(inputs, PrepareModuleInput) and not inputs.with_kwargs
                and _gathers_sequence(inputs.input_layouts, inputs.desired_input_layouts)):
            keep = KeepSequenceShard(inputs.use_local_output)
            if inputs is style:
                style = keep
            else:
                later[name], style = keep, style.prepare_module_output
        elif type(style) is ColwiseParallel and _gathers_sequence(style.input_layouts, style.desired_input_layouts):
            style = ColwiseParallel(input_layouts=Replicate(), output_layouts=style.output_layouts[0],
                                    use_local_output=style.use_local_output)
            later[name] = KeepSequenceShard()
        leaner[name] = style
    return leaner, later


def _parallelize(module: nn.Module, mesh, plan: dict) -> None:
    """`plan` applied with its sequence all-gathers keeping only the shard (`_keep_shards`) and LoRA's
    adapters split as their layer (`_parallelize_keeping_adapters`)."""
    plan, later = _keep_shards(plan)
    for style in (*plan.values(), *later.values()):
        # every rank holds the same weights (or a meta model, whose shards are initialized where they
        # land, parallel/materialize.py): each keeps its own slice, no scatter from rank 0
        if hasattr(style, "src_data_rank"):
            style.src_data_rank = None
    _parallelize_keeping_adapters(module, mesh, plan)
    for name, style in later.items():
        style._apply(module.get_submodule(name), mesh)


class TensorAxis(Axis):
    name = "tensor"

    def __init__(self, dims: ParallelDims, model: nn.Module):
        self.sequence_multiple = dims.tp if dims.sp else 1
        self.model = model
        self.in_step = False

    @contextlib.contextmanager
    def step_context(self, training: bool):
        """Training's loss and validation's alike on the vocabulary-sharded logits (the model keeps
        them sharded in eval mode too meanwhile)."""
        self.in_step = True
        try:
            with loss_parallel():
                yield
        finally:
            self.in_step = False

    def gather_logits_in_eval(self, module: nn.Module, args, output):
        """The model's forward hook: whole logits in eval mode outside a step (sampling, evaluation)."""
        if isinstance(output, DTensor) and not module.training and not self.in_step:
            return output.full_tensor()
        return output

    def after_backward(self) -> None:
        """The gradients left as partial sums over the tp ranks, summed once (module docstring)."""
        partial = [p for p in self.model.parameters()
                   if isinstance(p.grad, DTensor) and p.grad.placements == (Partial(),)]
        for dtype in {p.grad.dtype for p in partial}:
            group = [p for p in partial if p.grad.dtype == dtype]
            sums = torch.cat([p.grad.to_local().reshape(-1) for p in group])
            dist.all_reduce(sums, group=group[0].grad.device_mesh.get_group())
            for param, local in zip(group, sums.split([p.grad.numel() for p in group]), strict=True):
                param.grad = DTensor.from_local(local.view(param.grad.shape), param.grad.device_mesh, [Replicate()],
                                                run_check=False)


def apply_tensor_parallel(model: nn.Module, dims: ParallelDims, plan: ParallelPlan) -> tuple[nn.Module, Axis | None]:
    if dims.tp == 1:
        return model, None
    root_plan, block_plan = plan.tensor_parallel(dims.sp)
    # A pipeline part holds the embedding or the head only where its stages need them.
    _parallelize(model, dims.tp_mesh, {name: style for name, style in root_plan.items()
                                       if getattr(model, name.split(".")[0], None) is not None})
    for block in plan.blocks(model).values():
        _parallelize(block, dims.tp_mesh, block_plan(block))
    plan.tie_weights(model)
    axis = TensorAxis(dims, model)
    model.register_forward_hook(axis.gather_logits_in_eval)
    return model, axis
