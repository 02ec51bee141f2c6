"""training.precision auto, the trainer's default: bf16 on a GPU, fp32 on a CPU. Resolved when the
config is loaded, without torch (`ultratron plan` and `--show-config` never import it), and settled
by the trainer on the device it picks (`training/precision.py`)."""

from __future__ import annotations

import os
from pathlib import Path

from ultratron.planning.layout import PRECISIONS, Layout

AUTO = "auto"
AUTO_HELP = "auto (the trainer's default): bf16 on a GPU, fp32 on a CPU, whose fp32 matmuls a GPU runs in TF32; "


def precision_for(device_type: str) -> str:
    """What training.precision auto means on a device: bf16 on a GPU (its tensor cores' rate, half the
    activations), fp32 on a CPU (where bf16 autocast is emulated on most CPUs, and slower)."""
    return "bf16" if device_type == "cuda" else "fp32"


def gpu_visible() -> bool:
    """Whether this process will see an NVIDIA GPU, as far as can be told without importing torch:
    the driver lists a GPU and CUDA_VISIBLE_DEVICES does not hide them all. The trainer settles it
    on the device it picks."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1", "NoDevFiles"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def resolve_precision(training) -> None:
    """training.precision auto → a precision, by training.device (auto: whether a GPU is visible).
    The training section remembers that it was auto (`precision_auto`), for the trainer to resolve
    again on the device it actually picks."""
    if training.precision != AUTO:
        return
    device = training.device if training.device != "auto" else ("cuda" if gpu_visible() else "cpu")
    training.precision = precision_for(device)
    training.precision_auto = True


# take_fields' arguments for the trainer's precision field: the layout's definition, plus auto as
# its default and one more choice
TRAINER_PRECISION = {"precision": AUTO, "meta": {"precision": {
    "choices": (AUTO, *PRECISIONS), "help": AUTO_HELP + Layout.__dataclass_fields__["precision"].metadata["help"]}}}
