"""An in-process server on a loopback port, over a small random model, for the serving tests that
need to reach into it (its batcher, its engine) while real HTTP clients talk to it."""

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import torch

from ultratron.models.llama import Llama, LlamaArgs

VOCAB = 300


def small_model(max_seq_len: int = 256) -> torch.nn.Module:
    torch.manual_seed(0)
    args = LlamaArgs(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=VOCAB,
                     max_seq_len=max_seq_len)
    return Llama(args).eval().requires_grad_(False)


def corpus_tokenizer(corpus):
    from ultratron.data.tokenizer import train_tokenizer

    return train_tokenizer([p.read_text() for p in sorted(corpus.glob("*.py"))[:4]], VOCAB)


@contextlib.contextmanager
def running_server(model, tokenizer, **limits):
    """Yields (base url, Server) for a uvicorn server in a thread; `limits` are ServerLimits fields."""
    import uvicorn

    from ultratron.serving.server import Server, ServerLimits, create_app

    server = Server(model, tokenizer, limits=ServerLimits(**limits))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(400):
        if uv.started:
            break
        time.sleep(0.025)
    try:
        yield url, server
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        server.batcher.close()


def call(url: str, path: str, body=None, timeout: float = 60) -> tuple[int, object]:
    """(status, JSON body or text) of a POST with `body`, or a GET without."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read().decode()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw
