"""The Llama family, one folder: the model in plain PyTorch (`model.py`), how the parallel axes cut it
(`parallel_plan.py`), its map onto Hugging Face's format (`hf_adapter.py`) and its torch-free planning
formulas (`spec.py`). Other code reaches them through `models.registry` (and the planner through
`models.specs`); the names below load `model.py` (and torch) only when asked for, so that importing
`spec.py` stays torch-free."""

__all__ = ["Llama", "LlamaArgs", "build_model"]


def __getattr__(name: str):
    if name in __all__:
        from ultratron.models.llama import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
