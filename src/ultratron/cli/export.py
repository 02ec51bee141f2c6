"""Export a checkpoint to another format.

  ultratron export hf --checkpoint RUN/checkpoints/latest --out DIR [--dtype float32|bfloat16|float16] [--merge]
  ultratron export peft --checkpoint LORA_RUN/checkpoints/latest --out DIR

writes a Hugging Face model directory (config.json, model.safetensors, tokenizer files) that
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads: Llama, Qwen2, Qwen3, Mixtral or
Qwen3-MoE, whichever class holds the model (its family's adapter decides; docs/evaluation.md).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("format", choices=["hf", "peft"],
                        help="hf: Hugging Face transformers (safetensors); peft: a LoRA checkpoint's adapters as a "
                             "peft adapter for the transformers model under them")
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint, checkpoints or run directory; local or a URL such as s3://bucket/prefix")
    parser.add_argument("--checkpoint-endpoint", default=None,
                        help="endpoint URL of the S3-compatible store an s3:// --checkpoint is in "
                             "(default: $AWS_ENDPOINT_URL, else AWS)")
    parser.add_argument("--out", required=True, help="the directory to write (must not exist or be empty)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    parser.add_argument("--merge", action="store_true",
                        help="hf of a LoRA checkpoint: write the model with its adapters merged in "
                             "(W + alpha/rank · B A)")


def run(args: argparse.Namespace) -> int:
    import json

    from ultratron.checkpoint.hf import export_hf, export_peft
    from ultratron.checkpoint.inference import load_for_inference, read_lora
    from ultratron.checkpoint.store import resolve_checkpoint_dir
    from ultratron.config import load_config
    from ultratron.errors import ExportError
    from ultratron.models.registry import build_empty

    if args.format == "peft":
        ckpt = resolve_checkpoint_dir(args.checkpoint)
        cfg = load_config(ckpt / "config.toml")
        if cfg.lora.rank <= 0:
            raise ExportError(f"{ckpt} is no LoRA checkpoint (lora.rank = 0); export hf writes the whole model")
        model = read_lora(cfg, ckpt, build_empty(cfg.model).eval().requires_grad_(False))
        out = export_peft(model, cfg.lora, args.out, base=cfg.model.init_from)
        print(f"exported the LoRA adapters of {ckpt} to {out} (peft; rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g})")
        return 0
    loaded = load_for_inference(args.checkpoint, endpoint=args.checkpoint_endpoint)
    if loaded.config.lora.rank > 0 and not args.merge:
        raise ExportError(f"{loaded.checkpoint_dir} holds LoRA adapters: pass --merge to write the model with them "
                          "merged in, or export peft to write the adapters alone")
    out = export_hf(loaded.model, loaded.tokenizer, args.out, args.dtype)
    architecture = json.loads((out / "config.json").read_text(encoding="utf-8"))["architectures"][0]
    print(f"exported {loaded.checkpoint_dir} to {out} ({architecture}, {args.dtype})")
    return 0
