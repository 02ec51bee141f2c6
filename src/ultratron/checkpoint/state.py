"""The model and optimizer as one `Stateful`, keyed by parameter name with global shapes, so that
`torch.distributed.checkpoint` can cut them again for any other layout (dp2×tp2 → dp4, or one
process) — the same form in one process and in many.

ZeroRedundancyOptimizer (ZeRO-1) has no DCP support: each rank contributes the AdamW state of
the parameters it owns, under the names every other layout uses, so those checkpoints reshard too.

Tied embeddings: one process keeps one table, saved under both names for the weights but under
`tok_embeddings.weight` only for the optimizer. A pipeline's last stage keeps a copy of its own as
`output.weight` (`tied_copies`); its optimizer state is saved and loaded under the original's name,
so the checkpoint has the same keys in every layout.

Tensor subclasses that wrap a plain tensor (torchao's fp8 weights under FSDP2, `parallel/float8.py`,
which cast themselves to fp8 when gathered) are saved as the plain fp32 tensor they wrap: a
checkpoint holds torch's own tensors only, loadable without the library that made them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from ultratron.models.registry import plain_name as clean_param_name


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor a wrapper subclass holds (the tensor itself if it is plain), as a DTensor
    again when it was the local part of one."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if type(local) in (torch.Tensor, nn.Parameter) or not hasattr(local, "__tensor_flatten__"):
        return tensor
    names, _ = local.__tensor_flatten__()
    inner = getattr(local, names[0])
    if not isinstance(tensor, DTensor):
        return inner
    return DTensor.from_local(inner, tensor.device_mesh, tensor.placements, run_check=False,
                              shape=tensor.shape, stride=tensor.stride())


def _plain_tensors(state: dict) -> dict:
    return tree_map_only(torch.Tensor, _plain, state)


def _is_zero1(optimizer) -> bool:
    return type(optimizer).__name__ == "ZeroRedundancyOptimizer"


def _zero1_owned_state(model: nn.Module, optimizer) -> dict:
    """{"state": {name: {...}}} for the parameters this rank's ZeRO-1 shard owns (created empty
    before the first step, so that a load has tensors to fill)."""
    names = {id(p): clean_param_name(n) for n, p in model.named_parameters(remove_duplicate=True)}
    local = optimizer.optim
    out = {}
    for group in local.param_groups:
        for param in group["params"]:
            if param not in local.state:
                local.state[param] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
            out[names[id(param)]] = local.state[param]
    return {"state": out}


def _copies(model: nn.Module) -> dict[str, str]:
    return getattr(model, "tied_copies", {})


def _to_original_names(state: dict, copies: dict[str, str]) -> dict:
    """Optimizer state keyed by the names one process uses (a tied copy under its original's)."""
    out = {name: value for name, value in state.items() if name not in copies}
    for copy, original in copies.items():
        if copy in state:
            out.setdefault(original, state[copy])  # both copies on one rank hold equal state
    return out


def _to_own_names(state: dict, copies: dict[str, str], own: set[str]) -> dict:
    out = {name: value for name, value in state.items() if name in own}
    for copy, original in copies.items():
        if copy in own and original in state:  # its own tensors: the optimizer steps both copies
            out[copy] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state[original].items()}
    return out


@contextlib.contextmanager
def _gradients_set_aside(model: nn.Module, optimizer):
    """torch's get_state_dict creates a fresh optimizer's state (a zero-gradient step at lr 0) only
    when no parameter has a gradient; DDP's gradients exist from the start (views of its buckets,
    parallel/data.py). Without a state there is nothing to load into, so the state of a
    resumed run would silently start from zero: set the gradients aside for that and put them back."""
    if optimizer.state:
        yield
        return
    grads = [(param, param.grad) for param in model.parameters()]
    for param, _ in grads:
        param.grad = None
    try:
        yield
    finally:
        for param, grad in grads:
            param.grad = grad


class ModelState(Stateful):
    """Model weights, and optionally the optimizer state, of any layout. Only the per-parameter
    optimizer state is loaded: hyperparameters (lr, betas, weight decay) come from this run's config."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 select: Callable[[str], bool] | None = None):
        """`select`: which of the model's tensors (by name) are saved and loaded, e.g. only LoRA's
        adapters (their frozen model is another checkpoint); None: all."""
        self.model, self.optimizer, self.select = model, optimizer, select

    def _model_state(self, state: dict) -> dict:
        return state if self.select is None else {k: v for k, v in state.items() if self.select(k)}

    def _set_model_state(self, state: dict) -> None:
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=self.select is None))

    def state_dict(self) -> dict:
        return _plain_tensors(self._state_dict())

    def _state_dict(self) -> dict:
        if self.optimizer is None:
            return {"model": self._model_state(get_model_state_dict(self.model))}
        if _is_zero1(self.optimizer):
            return {"model": self._model_state(get_model_state_dict(self.model)),
                    "optimizer": _zero1_owned_state(self.model, self.optimizer)}
        with _gradients_set_aside(self.model, self.optimizer):
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": self._model_state(model_state),
                "optimizer": {"state": _to_original_names(optim_state["state"], _copies(self.model))}}

    def load_state_dict(self, state: dict) -> None:
        if self.optimizer is None or _is_zero1(self.optimizer):
            self._set_model_state(state["model"])  # ZeRO-1: its state was filled in place
            return
        # set_state_dict wants the param groups too: this run's own, keyed by name as in the state.
        with _gradients_set_aside(self.model, self.optimizer):
            _, current = get_state_dict(self.model, self.optimizer)
        optim = _to_own_names(state["optimizer"]["state"], _copies(self.model), set(current["state"]))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict={"state": optim, "param_groups": current["param_groups"]},
                       options=StateDictOptions(strict=self.select is None))
