"""Serve a checkpoint behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

  ultratron serve --checkpoint RUN/checkpoints/latest [--port 8000] [--api-key KEY]

Clients written for OpenAI's API work unchanged: point them at http://HOST:PORT/v1. Without --port
the server takes a free port and prints it, so two servers on one machine both start.
"""

from __future__ import annotations

import argparse
import os

from ultratron.config.inference import ServeSettings
from ultratron.config.loader import add_arguments as add_settings
from ultratron.config.loader import from_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, ServeSettings)


def run(args: argparse.Namespace) -> int:
    import torch

    from ultratron.checkpoint.inference import inference_dtype, load_for_inference
    from ultratron.errors import ConfigError
    from ultratron.serving.server import Server, ServerLimits, listen, serve

    s: ServeSettings = from_arguments(ServeSettings, args)
    problems = [f"--{name.replace('_', '-')} must be positive, got {getattr(s, name)}"
                for name in ("max_batch", "max_queue", "max_model_len") if (getattr(s, name) or 1) < 1]
    if problems:
        raise ConfigError(problems)
    if s.threads > 0:
        torch.set_num_threads(s.threads)
    dtype = inference_dtype(s.dtype, s.device)
    loaded = load_for_inference(s.checkpoint, s.device, s.checkpoint_endpoint, dtype)
    limits = ServerLimits(max_body_bytes=s.max_body_bytes, max_batch_rows=s.max_batch, max_queue=s.max_queue,
                          continuous=s.batching == "continuous", max_model_len=s.max_model_len,
                          request_timeout=s.request_timeout or None, prefix_cache_tokens=s.prefix_cache_tokens,
                          max_batched_tokens=s.max_batched_tokens, kv_cache_tokens=s.kv_cache_tokens)
    loaded.tokenizer.encode("warm-up")  # (tiktoken's encoder is built now, not in the first request: ~12 ms)
    server = Server(loaded.model, loaded.tokenizer, s.model_name, s.api_key or os.environ.get("ULTRATRON_API_KEY"),
                    limits)
    sock = listen(s.host, s.port)  # before the line below, which names the port really served
    port = sock.getsockname()[1]
    print(f"serving {loaded.checkpoint_dir} as {s.model_name!r} on http://{s.host}:{port}/v1 "
          f"({str(dtype).removeprefix('torch.')}, {s.batching} "
          f"batching, up to {s.max_batch} sequences of up to {server.context} positions; KV cache "
          f"{server.batcher.kv_tokens} tokens = {server.batcher.kv_bytes / 2**20:.0f} MiB (paged, blocks of "
          f"{server.batcher.engine.cache.block}); prefix cache {s.prefix_cache_tokens} tokens = "
          f"{server.batcher.prefix_cache_bytes / 2**20:.0f} MiB; {s.max_batched_tokens} prompt tokens per "
          f"iteration)", flush=True)
    serve(server, sock)
    return 0
