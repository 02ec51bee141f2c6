"""Export a checkpoint to another format.

  ultratron export hf --checkpoint RUN/checkpoints/latest --out DIR [--dtype float32|bfloat16|float16]

writes a Hugging Face Llama directory (config.json, model.safetensors, tokenizer files) that
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("format", choices=["hf"], help="hf: Hugging Face Llama (safetensors)")
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint, checkpoints or run directory; local or a URL such as s3://bucket/prefix")
    parser.add_argument("--checkpoint-endpoint", default=None,
                        help="endpoint URL of the S3-compatible store an s3:// --checkpoint is in "
                             "(default: $AWS_ENDPOINT_URL, else AWS)")
    parser.add_argument("--out", required=True, help="the directory to write (must not exist or be empty)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")


def run(args: argparse.Namespace) -> int:
    from ultratron.checkpoint.hf import export_hf
    from ultratron.checkpoint.inference import load_for_inference

    loaded = load_for_inference(args.checkpoint, endpoint=args.checkpoint_endpoint)
    out = export_hf(loaded.model, loaded.tokenizer, args.out, args.dtype)
    print(f"exported {loaded.checkpoint_dir} to {out} (Hugging Face Llama, {args.dtype})")
    return 0
