"""Import a local Hugging Face Llama-family model (Llama, Mistral, Qwen2) as an ultratron checkpoint.

The inverse of `hf.py`'s export: config.json → the model section of our config, HF tensor names →
ours, and each head's q/k rows permuted back from HF's rotate-half layout to our interleaved RoPE
pairs. The weights stream tensor by tensor from the safetensors files (one file, or the shards a
`model.safetensors.index.json` lists) into the checkpoint: a DCP save planner reads each tensor
only when it is written, so a model larger than memory imports in a tensor's worth of memory.
The checkpoint is written by `manager.CheckpointWriter`, the one save path.

What does not map onto our Llama is refused, every problem listed: other architectures, biases
other than Qwen2's q/k/v ones, an explicit head_dim other than hidden_size / heads, RoPE scaling
types we do not implement (dynamic NTK, YaRN, LongRoPE), partial rotary embeddings, a sliding
window shorter than the context, quantized weights, a tokenizer without tokenizer.json or EOS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.stateful import Stateful

from ultratron.checkpoint.hf import LAYER_NAMES
from ultratron.checkpoint.manager import CheckpointWriter, WriteOptions
from ultratron.checkpoint.state import ModelState
from ultratron.checkpoint.store import CheckpointRoot
from ultratron.config import Config, load_config, to_toml
from ultratron.config.loader import apply_tables
from ultratron.config.training import ModelConfig
from ultratron.data.tokenizer import Tokenizer
from ultratron.errors import CheckpointError
from ultratron.models.llama import build_model

FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers some older checkpoints carry; recomputed here


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: cannot be read as JSON ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _rope(hf: dict) -> tuple[float, str, dict, list[str]]:
    """(rope_theta, our scaling name, its numbers, problems) from rope_parameters or rope_scaling."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        return theta, "none", {}, [f"rope scaling type {kind!r}: ultratron implements "
                                   f"{', '.join(ROPE_TYPES)} only"]
    names = {"linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    numbers = {k: float(params[k]) for k in names.get(kind, ()) if params.get(k) is not None}
    missing = [k for k in names.get(kind, ()) if k not in numbers]
    return theta, ROPE_TYPES[kind], numbers, [f"rope scaling {kind!r} lacks {k}" for k in missing]


def map_config(hf: dict, max_seq_len: int | None = None) -> tuple[dict, list[str]]:
    """ModelConfig fields for a Hugging Face config.json, and every reason it does not map."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        return {}, [f"model_type {family!r} is not a Llama-family model ultratron can hold "
                    f"(supported: {', '.join(FAMILIES)})"]
    p: list[str] = []
    dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    context = int(hf.get("max_position_embeddings", 2048))
    if max_seq_len is not None:
        context = min(context, max_seq_len)
    theta, scaling, scaling_params, rope_problems = _rope(hf)
    p += rope_problems
    fields_ = {
        "preset": None, "n_layers": int(hf["num_hidden_layers"]), "dim": dim, "n_heads": heads,
        "n_kv_heads": int(hf.get("num_key_value_heads") or heads), "ffn_dim": int(hf["intermediate_size"]),
        "vocab_size": int(hf["vocab_size"]), "max_seq_len": context,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "rope_theta": theta,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "init_std": float(hf.get("initializer_range", 0.02)),
        "qkv_bias": family == "qwen2", "rope_scaling": scaling, "rope_scaling_params": scaling_params,
    }
    if hf.get("hidden_act", "silu") != "silu":
        p.append(f"hidden_act {hf['hidden_act']!r}: ultratron's feed-forward is SwiGLU (silu)")
    if hf.get("attention_bias"):
        p.append("attention_bias=true: ultratron's Llama has no biases on the attention projections")
    if hf.get("mlp_bias"):
        p.append("mlp_bias=true: ultratron's feed-forward has no biases")
    if hf.get("head_dim") is not None and int(hf["head_dim"]) * heads != dim:
        p.append(f"head_dim={hf['head_dim']} but hidden_size/num_attention_heads = {dim / heads:g}: ultratron "
                 "derives the head dimension from the width")
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        p.append(f"partial_rotary_factor={hf['partial_rotary_factor']}: ultratron rotates every channel")
    window = hf.get("sliding_window")
    uses_window = window is not None and (family == "mistral" or hf.get("use_sliding_window", False))
    if uses_window and int(window) < context:
        p.append(f"sliding_window={window} is shorter than the context ({context}): ultratron attends over the "
                 f"whole context; import with --max-seq-len {window} (within the window the two are identical)")
    if hf.get("quantization_config"):
        p.append("quantized weights (quantization_config): import an unquantized model")
    return fields_, p


def _tensor_files(root: Path) -> tuple[dict[str, Path], list[str]]:
    """tensor name → safetensors file, from the shard index or the single file."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        files = {name: root / file for name, file in weight_map.items()}
        missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
        return files, [f"{index.name} lists {m}, which is missing" for m in missing]
    single = root / "model.safetensors"
    if not single.is_file():
        old = " (it holds PyTorch .bin weights; save it with safe_serialization=True)" if any(
            root.glob("pytorch_model*.bin")) else ""
        return {}, [f"no model.safetensors or model.safetensors.index.json{old}"]
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as fh:
        return {name: single for name in fh.keys()}, []


def expected_names(cfg: ModelConfig) -> dict[str, str]:
    """HF tensor name → our parameter name, for every tensor the HF checkpoint must hold."""
    out = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight"}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = "output.weight"
    biased = {"attention.wq", "attention.wk", "attention.wv"} if cfg.qkv_bias else set()
    for i in range(cfg.n_layers):
        for ours, theirs in LAYER_NAMES.items():
            for kind in ("weight", "bias") if ours in biased else ("weight",):
                out[f"model.layers.{i}.{theirs}.{kind}"] = f"layers.{i}.{ours}.{kind}"
    return out


def half_split_to_rope(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `hf.rope_to_half_split`: each head's halves (0,2,4…, 1,3,5…) back to pairs."""
    out_dim, rest = weight.shape[0], weight.shape[1:]
    head_dim = out_dim // n_heads
    return weight.reshape(n_heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(out_dim, *rest)


@dataclass
class HFModel:
    """A Hugging Face model directory that maps onto ultratron: its config and where each tensor is."""

    root: Path
    hf_config: dict
    model: ModelConfig
    files: dict[str, Path]  # HF tensor name → safetensors file
    names: dict[str, str]  # HF tensor name → our parameter name
    tokenizer: Tokenizer


def _tokenizer(root: Path, hf: dict) -> tuple[Tokenizer | None, list[str]]:
    if not (root / "tokenizer.json").is_file():
        return None, ["no tokenizer.json (a fast tokenizer): save the tokenizer with transformers' "
                      "AutoTokenizer.save_pretrained first"]
    eos_id = hf.get("eos_token_id")
    generation = root / "generation_config.json"
    if eos_id is None and generation.is_file():
        eos_id = _read_json(generation).get("eos_token_id")
    if isinstance(eos_id, list):
        eos_id = eos_id[0] if eos_id else None
    from tokenizers import Tokenizer as HFTokenizer

    eos = None if eos_id is None else HFTokenizer.from_file(str(root / "tokenizer.json")).id_to_token(int(eos_id))
    try:
        return Tokenizer.load(root / "tokenizer.json", eos_token=eos), []
    except Exception as err:  # DataError for a missing EOS; tokenizers errors for malformed files
        return None, [str(err)]


def inspect_hf(model_dir: str | Path, max_seq_len: int | None = None) -> HFModel:
    """Check a Hugging Face directory against ultratron's Llama; CheckpointError lists every problem."""
    root = Path(model_dir)
    if not (root / "config.json").is_file():
        raise CheckpointError(f"{root}: not a Hugging Face model directory (no config.json)")
    hf = _read_json(root / "config.json")
    try:
        mapped, problems = map_config(hf, max_seq_len)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{root}/config.json: missing or malformed field ({err})") from None
    files, file_problems = _tensor_files(root)
    tokenizer, tok_problems = _tokenizer(root, hf)
    problems += file_problems + tok_problems
    if mapped:
        model = ModelConfig(**mapped)
        names = expected_names(model)
        present = {n for n in files if not n.endswith(IGNORED_SUFFIXES)}
        problems += [f"tensor {n} is missing" for n in sorted(set(names) - present) if files]
        extra = sorted(present - set(names) - ({"lm_head.weight"} if model.tie_embeddings else set()))
        problems += [f"tensor {n} has no place in ultratron's Llama" for n in extra[:10]]
        if len(extra) > 10:
            problems.append(f"... and {len(extra) - 10} more such tensors")
        if tokenizer is not None and tokenizer.vocab_size > model.vocab_size:
            problems.append(f"the tokenizer has {tokenizer.vocab_size} tokens, more than vocab_size={model.vocab_size}")
    if problems:
        raise CheckpointError([f"cannot import {root}: {p}" for p in problems])
    return HFModel(root, hf, model, files, names, tokenizer)


class TensorSource:
    """Our parameters, read one at a time from the safetensors files and converted (fp32, RoPE rows)."""

    def __init__(self, hf_model: HFModel):
        self.model = hf_model.model
        self.ours_to_hf = {ours: theirs for theirs, ours in hf_model.names.items()}
        if self.model.tie_embeddings:
            self.ours_to_hf["output.weight"] = "model.embed_tokens.weight"
        self.files = hf_model.files
        self._handles: dict[Path, object] = {}
        self.loaded = 0  # tensors read so far

    def shape(self, ours: str) -> list[int]:
        return list(self._handle(self.files[self.ours_to_hf[ours]]).get_slice(self.ours_to_hf[ours]).get_shape())

    def _handle(self, file: Path):
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]

    def tensor(self, ours: str) -> torch.Tensor:
        name = self.ours_to_hf[ours]
        tensor = self._handle(self.files[name]).get_tensor(name).to(torch.float32)
        self.loaded += 1
        if ".attention.wq." in ours:
            return half_split_to_rope(tensor, self.model.n_heads).contiguous()
        if ".attention.wk." in ours:
            return half_split_to_rope(tensor, self.model.n_kv_heads).contiguous()
        return tensor

    def close(self) -> None:
        self._handles.clear()


class _LazyModelState(Stateful):
    """A ModelState's names and shapes (meta tensors, no memory) for planning the DCP save."""

    def __init__(self, model_cfg: ModelConfig):
        self.template = ModelState(build_model(model_cfg, "meta")).state_dict()

    def state_dict(self) -> dict:
        return self.template

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError("write-only")


class _StreamingPlanner(DefaultSavePlanner):
    """Resolves each write item by reading that tensor from the source (`app.model.NAME` → NAME)."""

    def __init__(self, source: TensorSource):
        super().__init__()
        self.source = source

    def resolve_data(self, write_item):
        return self.source.tensor(write_item.index.fqn.removeprefix("app.model."))


def _check_shapes(root: Path, source: TensorSource, template: dict) -> None:
    bad = [f"tensor {source.ours_to_hf[n]} has shape {source.shape(n)}, config.json implies {list(t.shape)}"
           for n, t in template["model"].items() if source.shape(n) != list(t.shape)]
    if bad:
        raise CheckpointError([f"cannot import {root}: {b}" for b in bad])


def run_config(hf_model: HFModel, out: Path) -> Config:
    """The config to continue training from: the model from config.json, starting from the import."""
    data = {"model": {f.name: getattr(hf_model.model, f.name) for f in fields(ModelConfig)
                      if getattr(hf_model.model, f.name) is not None}}
    seq = min(256, hf_model.model.max_seq_len)
    micro = 8
    data["training"] = {"seq_len": seq, "micro_batch_size": micro,
                        "batch_tokens": micro * seq * max(1, -(-8192 // (micro * seq)))}
    data["optim"] = {"lr": 1e-4}  # continued training: far below the from-scratch default
    data["run"] = {"dir": str(out.resolve())}
    cfg = Config()
    problems: list[str] = []
    apply_tables(cfg, data, problems)
    if problems:
        raise CheckpointError(problems)
    cfg = load_config(base=cfg)
    cfg.model.init_from = str(out.resolve())
    return cfg


def import_hf(model_dir: str | Path, out_dir: str | Path, max_seq_len: int | None = None) -> Path:
    """Write RUN_DIR/config.toml and RUN_DIR/checkpoints/step-0000000 (weights only) from an HF model."""
    out = Path(out_dir)
    hf_model = inspect_hf(model_dir, max_seq_len)
    if (out / "checkpoints").exists() or (out / "config.toml").exists():
        raise CheckpointError(f"{out} already holds a run; choose a new --out directory")
    cfg = run_config(hf_model, out)
    source = TensorSource(hf_model)
    state = _LazyModelState(hf_model.model)
    _check_shapes(hf_model.root, source, state.template)
    root = CheckpointRoot(out / "checkpoints")
    files = {"config.toml": to_toml(cfg), **hf_model.tokenizer.files(),
             "imported_from.json": json.dumps({"source": str(Path(model_dir).resolve()),
                                               "architectures": hf_model.hf_config.get("architectures")}) + "\n"}
    try:
        writer = CheckpointWriter(root, on_commit=root.point_latest)
        final = writer.write(0, state, files=files, options=WriteOptions(planner=_StreamingPlanner(source))).result()
    finally:
        source.close()
    (out / "config.toml").write_text(to_toml(cfg), encoding="utf-8")
    return final
