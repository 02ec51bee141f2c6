"""Serve a checkpoint behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

  ultratron serve --checkpoint RUN/checkpoints/latest --port 8000 [--api-key KEY]

Clients written for OpenAI's API work unchanged: point them at http://HOST:PORT/v1.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="a checkpoint, checkpoints or run directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("ULTRATRON_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $ULTRATRON_API_KEY; none: open)")
    parser.add_argument("--model-name", default="ultratron", help="the model id clients pass (default ultratron)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-batch", type=int, default=32, help="most sequences generated together")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")


def run(args: argparse.Namespace) -> int:
    import torch

    from ultratron.serving.loading import load_model
    from ultratron.serving.server import Server, ServerLimits, serve

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.checkpoint, args.device)
    server = Server(loaded.model, loaded.tokenizer, args.model_name, args.api_key,
                    ServerLimits(max_body_bytes=args.max_body_bytes, max_batch_rows=args.max_batch))
    print(f"serving {loaded.checkpoint_dir} as {args.model_name!r} on http://{args.host}:{args.port}/v1",
          flush=True)
    serve(server, args.host, args.port)
    return 0
