"""Export to Hugging Face's format: config.json, model.safetensors, tokenizer files.

The model's family maps itself (`models/FAMILY/hf_adapter.py`, found through `models.registry`):
which transformers class it is written as, its config.json fields and its tensors under their
names and layouts (the Llama family: Llama, Qwen2, Qwen3, Mixtral, Qwen3-MoE). What the class cannot
hold is refused, every reason listed, before anything is written. This module does the I/O: the
tensors in the requested dtype, the tokenizer files, one atomic rename. `hf_import.py` is the inverse.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ultratron.atomic import atomic_path
from ultratron.data.chat import chat_template_of
from ultratron.errors import ExportError
from ultratron.models.family import HFAdapter
from ultratron.models.registry import hf_adapter_of, model_args

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_config(adapter: HFAdapter, args, eos_id: int, dtype: str, bos_id: int | None = None) -> dict:
    return adapter.hf_config(args) | {"bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": dtype,
                                      "dtype": dtype}


def hf_state_dict(adapter: HFAdapter, state: dict, args, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Our tensors → the transformers ones, by the family's weight map (a tied head is the embedding)."""
    out = {}
    for ours, tensors in adapter.weight_map(args).items():
        out |= dict(zip(tensors.hf, tensors.to_hf(state[ours]), strict=True))
    return {k: v.detach().to(dtype).contiguous().clone() for k, v in out.items()}


def export_hf(model, tokenizer, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write a Hugging Face model directory for `model` (an ultratron model) and its tokenizer."""
    from safetensors.torch import save_file

    adapter, args = hf_adapter_of(model), model_args(model)
    state = model.state_dict()
    problems = adapter.export_problems(args, state)
    if problems:
        raise ExportError(problems)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty; choose a new --out directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(adapter, state, args, DTYPES[dtype])
    with atomic_path(out) as tmp:  # the directory appears whole (replacing an empty `out`) or not at all
        tmp.mkdir()
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_json = lambda name, data: (tmp / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        bos = tokenizer.bos_token
        bos_id = None if bos is None else tokenizer.hf.token_to_id(bos)
        write_json("config.json", hf_config(adapter, args, tokenizer.eos_id, dtype, bos_id))
        write_json("generation_config.json", {"eos_token_id": tokenizer.eos_id, "bos_token_id": bos_id})
        (tmp / "tokenizer.json").write_text(tokenizer.to_json(), encoding="utf-8")
        write_json("tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tokenizer.eos_token, "bos_token": bos,
            "pad_token": None, "unk_token": None, "model_max_length": args.max_seq_len,
            "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False,
            "chat_template": chat_template_of(tokenizer)})  # its own, or the one ultratron trained and serves with
        write_json("special_tokens_map.json", {"eos_token": tokenizer.eos_token,
                                               **({"bos_token": bos} if bos else {})})
    return out


def export_peft(model, lora_cfg, out_dir: str | Path, base: str | None = None) -> Path:
    """Write `model`'s LoRA adapters (`models/lora.py`) as a peft adapter directory
    (adapter_config.json, adapter_model.safetensors) for the Hugging Face export of the model under
    them: each adapter under its layer's transformers name, B's rows in that layer's layout (the
    RoPE row order of q and k), A as it is."""
    from safetensors.torch import save_file

    adapter, args = hf_adapter_of(model), model_args(model)
    state = model.state_dict()
    weight_map = adapter.weight_map(args)
    tensors, modules = {}, set()
    for name in sorted(k.removesuffix(".lora_a") for k in state if k.endswith(".lora_a")):
        mapped = weight_map[f"{name}.weight"]
        (hf_weight,) = mapped.hf
        layer = hf_weight.removesuffix(".weight")
        (b,) = mapped.to_hf(state[f"{name}.lora_b"])
        tensors[f"base_model.model.{layer}.lora_A.weight"] = state[f"{name}.lora_a"].float().contiguous().clone()
        tensors[f"base_model.model.{layer}.lora_B.weight"] = b.float().contiguous().clone()
        modules.add(layer.rsplit(".", 1)[-1])
    if not tensors:
        raise ExportError("the checkpoint holds no LoRA adapters (lora.rank = 0); export hf writes the whole model")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty; choose a new --out directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha,
              "target_modules": sorted(modules), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
              "modules_to_save": None, "base_model_name_or_path": base}
    with atomic_path(out) as tmp:
        tmp.mkdir()
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out
