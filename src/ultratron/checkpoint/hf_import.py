"""Import a local Hugging Face model (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE) as an ultratron
checkpoint.

The inverse of `hf.py`'s export, through the same family adapter (`models/FAMILY/hf_adapter.py`):
config.json → the model section of our config, transformers' tensors → ours (each head's q/k rows
permuted back from the rotate-half layout to our interleaved RoPE pairs, a mixture of experts'
per-expert tensors stacked into our 3-D ones). The weights stream tensor by tensor from the
safetensors files (one file, or the shards a `model.safetensors.index.json` lists) into the
checkpoint: a DCP save planner reads the tensors of one of ours only when it is written, so a model
larger than memory imports in a tensor's worth of memory. The checkpoint is written by
`manager.CheckpointWriter`, the one save path.

What does not map onto our decoder is refused, every problem listed: other architectures (DeepSeek-V3:
multi-head latent attention, which our decoder lacks), biases other than Qwen2's q/k/v ones, RoPE
scaling types we do not implement (dynamic NTK, YaRN, LongRoPE), partial rotary embeddings, a sliding
window shorter than the context, dense layers of a mixture of experts that are not the first ones,
quantized weights, a tokenizer without tokenizer.json or EOS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.stateful import Stateful

from ultratron.checkpoint.manager import CheckpointWriter, WriteOptions
from ultratron.checkpoint.state import ModelState
from ultratron.checkpoint.store import CheckpointRoot
from ultratron.config import Config, load_config, to_toml
from ultratron.config.loader import apply_tables
from ultratron.config.training import ModelConfig
from ultratron.data.tokenizer import Tokenizer
from ultratron.errors import CheckpointError
from ultratron.models.family import HFAdapter, HFTensors
from ultratron.models.registry import build_model, hf_architectures, hf_family


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: cannot be read as JSON ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def map_config(hf: dict, max_seq_len: int | None = None) -> tuple[dict, list[str]]:
    """ModelConfig fields for a Hugging Face config.json (by the family that holds its model_type), and
    every reason it does not map."""
    family = hf_family(hf.get("model_type"))
    if family is None:
        return {}, [f"model_type {hf.get('model_type')!r} is not a model ultratron can hold "
                    f"(supported: {', '.join(hf_architectures())})"]
    fields, problems = family.hf.config_from_hf(hf, max_seq_len)
    return (fields and {**fields, "family": family.name}), problems


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


@dataclass
class HFModel:
    """A Hugging Face model directory that maps onto ultratron: its config and where each tensor is."""

    root: Path
    hf_config: dict
    model: ModelConfig
    files: dict[str, Path]  # HF tensor name → safetensors file
    tensors: dict[str, HFTensors]  # our tensor name → the HF tensors it is made of
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
    """Check a Hugging Face directory against the family that holds its model_type; CheckpointError lists
    every problem."""
    root = Path(model_dir)
    if not (root / "config.json").is_file():
        raise CheckpointError(f"{root}: not a Hugging Face model directory (no config.json)")
    hf = _read_json(root / "config.json")
    try:
        mapped, problems = map_config(hf, max_seq_len)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{root}/config.json: missing or malformed field ({err})") from None
    if not mapped:  # an architecture ultratron cannot hold: its files do not matter
        raise CheckpointError([f"cannot import {root}: {p}" for p in problems])
    files, file_problems = _tensor_files(root)
    tokenizer, tok_problems = _tokenizer(root, hf)
    problems += file_problems + tok_problems
    model = ModelConfig(**mapped)
    adapter: HFAdapter = hf_family(hf["model_type"]).hf
    args = adapter.args_from_config(model)
    tensors = adapter.weight_map(args)
    names = {name for t in tensors.values() for name in t.hf}
    present = set(files) - adapter.ignored(args)
    problems += [f"tensor {n} is missing" for n in sorted(names - present) if files]
    extra = sorted(present - names)
    problems += [f"tensor {n} has no place in ultratron's {hf['model_type']} model" for n in extra[:10]]
    if len(extra) > 10:
        problems.append(f"... and {len(extra) - 10} more such tensors")
    if tokenizer is not None and tokenizer.vocab_size > model.vocab_size:
        problems.append(f"the tokenizer has {tokenizer.vocab_size} tokens, more than vocab_size={model.vocab_size}")
    if problems:
        raise CheckpointError([f"cannot import {root}: {p}" for p in problems])
    return HFModel(root, hf, model, files, tensors, tokenizer)


class TensorSource:
    """Our tensors, each read from the safetensors files (fp32) and made by the family's weight map."""

    def __init__(self, hf_model: HFModel):
        self.tensors = hf_model.tensors
        self.files = hf_model.files
        self._handles: dict[Path, object] = {}
        self.loaded = 0  # tensors of ours made so far

    def hf_shapes(self, ours: str) -> list[list[int]]:
        return [list(self._handle(self.files[n]).get_slice(n).get_shape()) for n in self.tensors[ours].hf]

    def shape(self, ours: str) -> list[int] | None:
        """The shape `tensor(ours)` will have (None: the HF tensors' shapes do not fit together)."""
        try:
            return list(self.tensors[ours].from_hf([torch.empty(s, device="meta") for s in self.hf_shapes(ours)]).shape)
        except (RuntimeError, ValueError):
            return None

    def _handle(self, file: Path):
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]

    def tensor(self, ours: str) -> torch.Tensor:
        tensors = self.tensors[ours]
        parts = [self._handle(self.files[n]).get_tensor(n).to(torch.float32) for n in tensors.hf]
        self.loaded += 1
        return tensors.from_hf(parts).to(torch.float32).contiguous()

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
    bad = []
    for ours, want in template["model"].items():
        if source.shape(ours) != list(want.shape):
            hf = source.tensors[ours].hf
            shapes = source.hf_shapes(ours)
            got = f"has shape {shapes[0]}" if len(hf) == 1 else f"and the {len(hf) - 1} like it have shapes {shapes}"
            bad.append(f"tensor {hf[0]} {got}, config.json implies {list(want.shape)} for {ours}")
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
