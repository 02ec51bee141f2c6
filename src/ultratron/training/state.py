"""The training run's own state as a `Stateful`: the step, the data loader's position and the
random number generators — what a checkpoint needs besides the model and the optimizer."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful


def rng_state() -> dict:
    """The generators this process draws from: Python's, NumPy's, the CPU's, and its own GPU's only
    (`torch.cuda.get_rng_state()` of the current device, one state). A state of every visible GPU
    would tie the checkpoint to the node's GPU count: a resume that sees fewer GPUs could not set it."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def own_cuda_state(saved, device_index: int) -> torch.Tensor | None:
    """This process's GPU generator state from what a checkpoint holds under "cuda": one state (this
    format), or a list with one state per GPU visible to the rank that wrote it (checkpoints before
    it). From a list, the entry at this process's device index, which is the GPU that rank computed
    on (one GPU per local rank, the same index on a node of the same shape); None when the list has
    no entry there (a resume on a node whose GPUs differ): the generator then keeps its seeding."""
    if isinstance(saved, (list, tuple)):
        return saved[device_index] if device_index < len(saved) else None
    return saved


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        own = own_cuda_state(state["cuda"], torch.cuda.current_device())
        if own is not None:
            torch.cuda.set_rng_state(own)


class TrainState(Stateful):
    """The step counter, the tokens trained on (which a batch ramp follows), the tokens that
    counted in the loss (runs with a loss mask) and the loader's position; the RNGs are captured
    when saved."""

    def __init__(self, loader, config: dict | None = None):
        self.step = 0
        self.tokens = 0  # positions computed
        self.loss_tokens = 0  # of those, the targets the loss counted (counted only where some do not)
        self.loader = loader
        self.config = config or {}
        self.saved_config: dict = {}  # the config of the run a loaded checkpoint was written by

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "loss_tokens": self.loss_tokens,
                "loader": self.loader.state_dict(), "rng": rng_state(), "config": self.config}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])  # a global position: any layout reads on from it
        self.saved_config = state.get("config") or {}
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        # (checkpoints from before the ramp hold no tokens: they trained at a fixed batch)
        fixed = self.step * int(self.config.get("training", {}).get("batch_tokens", 0))
        self.tokens = int(state.get("tokens", fixed))
        self.loss_tokens = int(state.get("loss_tokens", 0))  # (not counted before this was kept)
