"""Import a model from another format.

  ultratron import hf --model HF_DIR --out RUN_DIR [--max-seq-len N]

reads a local Hugging Face model (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE: config.json, safetensors —
one file or shards with model.safetensors.index.json — and tokenizer.json) tensor by tensor and
writes an ultratron run directory: RUN_DIR/checkpoints/step-0000000 (the weights, the tokenizer
with its chat template) and RUN_DIR/config.toml, whose model section is the imported shape and
whose model.init_from points at the import. Continue training with

  ultratron train --config RUN_DIR/config.toml --data.path DATA --run.dir runs/NEW

(or in place: --run.dir RUN_DIR --checkpoint.resume auto); evaluate, serve or export RUN_DIR
like any checkpoint. What does not map onto ultratron's decoder is refused, each reason on a line
(DeepSeek-V3: its multi-head latent attention).
Nothing is downloaded: HF_DIR is a directory on disk.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("format", choices=["hf"],
                        help="hf: a Hugging Face model directory (Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE)")
    parser.add_argument("--model", required=True, help="the local Hugging Face model directory")
    parser.add_argument("--out", required=True, help="the run directory to write (must not hold a run)")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="cap the context (default: the model's max_position_embeddings); also admits a "
                             "sliding-window model whose window is at least this long")


def run(args: argparse.Namespace) -> int:
    from ultratron.checkpoint.hf_import import import_hf
    from ultratron.errors import CheckpointError

    if args.max_seq_len is not None and args.max_seq_len <= 0:
        raise CheckpointError(f"--max-seq-len must be positive, got {args.max_seq_len}")
    final = import_hf(args.model, args.out, args.max_seq_len)
    print(f"imported {args.model} to {final}\n"
          f"continue training: ultratron train --config {args.out}/config.toml --data.path DATA --run.dir runs/NEW")
    return 0
