"""The Llama family: the model (plain PyTorch) and, beside it, how parallelism cuts it."""

from ultratron.models.llama.model import Llama, LlamaArgs, build_model

__all__ = ["Llama", "LlamaArgs", "build_model"]
