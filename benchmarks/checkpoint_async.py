"""How long a checkpoint save blocks the training loop: asynchronous (DCP async_save: a copy into
host memory, the write in the background) vs synchronous, for the same model and AdamW state, on
local disk and on an S3-compatible server on loopback (moto's server mode). Prints medians and
the ratio, measured side by side in one process.

  python benchmarks/checkpoint_async.py [--params 25e6] [--repeats 3] [--no-s3]

Each save sits in a training loop as the trainer has it: the save is called after an optimizer
step; the next step's forward and backward run (a real one on the benchmark's model); then the
loop waits for the save's copy into host memory to finish (`before_update`) and steps the
optimizer. "Blocked" is the save call plus that wait: the time the loop stands still because of
the checkpoint. The forward/backward is also timed with and without a save in flight, since on a
CPU the background copy and write share the cores with it (reported as "slowdown").
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
import uuid

import torch

from ultratron.checkpoint.checkpointer import Checkpointer
from ultratron.checkpoint.manager import ModelState


class Counter:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def model_and_optimizer(params: float):
    width = 1024
    layers = max(1, round(params / (width * width)))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()  # AdamW state exists: the checkpoint holds 3 × the weights
    return model, optimizer


def forward_backward(model, batch) -> float:
    start = time.perf_counter()
    model(batch).square().mean().backward()
    return time.perf_counter() - start


def measure(root: str, model, optimizer, asynchronous: bool, repeats: int, endpoint: str | None = None):
    """Medians of (blocked s, written-by s, forward/backward s with the save in flight, without)."""
    checkpointer = Checkpointer(root, keep=2, endpoint=endpoint, asynchronous=asynchronous)
    batch = torch.randn(512, model[0].in_features)
    blocked, total, during, alone = [], [], [], []
    for step in range(1, repeats + 1):
        alone.append(forward_backward(model, batch))
        optimizer.step()
        start = time.perf_counter()
        pending = checkpointer.save(step, ModelState(model, optimizer), Counter(), {"config.toml": ""})
        called = time.perf_counter() - start
        during.append(forward_backward(model, batch))  # the next step, while the save runs
        wait_start = time.perf_counter()
        checkpointer.before_update()
        blocked.append(called + time.perf_counter() - wait_start)
        optimizer.step()
        optimizer.zero_grad()
        outcome = checkpointer.wait()
        total.append(time.perf_counter() - start)
        if outcome.error:
            raise SystemExit(f"save failed: {outcome.error}")
        assert pending.done()
    return tuple(statistics.median(v) for v in (blocked, total, during, alone))


def s3_server():
    for key, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(key, value)
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    import s3fs

    endpoint = f"http://127.0.0.1:{port}"
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(endpoint_url=endpoint).mkdir(bucket)
    return server, endpoint, bucket


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=25e6, help="model parameters (the checkpoint is ~12 B each)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-s3", action="store_true", help="local disk only")
    args = parser.parse_args()
    model, optimizer = model_and_optimizer(args.params)
    n = sum(p.numel() for p in model.parameters())
    print(f"state: {n / 1e6:.1f} M parameters + AdamW moments = {3 * n * 4 / 2**20:.0f} MB; "
          f"{args.repeats} saves each, medians; {torch.get_num_threads()} threads")
    targets = [("local disk", None, None)]
    server = None
    if not args.no_s3:
        server, endpoint, bucket = s3_server()
        targets.append(("S3 on loopback (moto)", endpoint, bucket))
    try:
        for name, endpoint, bucket in targets:
            with tempfile.TemporaryDirectory() as tmp:
                root = tmp if endpoint is None else f"s3://{bucket}/{uuid.uuid4().hex[:6]}"
                sync_blocked, *_ = measure(root + "/sync" if endpoint is None else root + "-sync", model, optimizer,
                                           False, args.repeats, endpoint)
                async_blocked, async_total, during, alone = measure(
                    root + "/async" if endpoint is None else root + "-async", model, optimizer, True, args.repeats,
                    endpoint)
            print(f"{name:>22}: synchronous save blocks {sync_blocked:.3f} s; asynchronous blocks "
                  f"{async_blocked:.3f} s (written in {async_total:.3f} s in the background); "
                  f"ratio {async_blocked / sync_blocked:.1%}; forward/backward {alone:.3f} s alone, "
                  f"{during:.3f} s with the save in flight (slowdown {during / alone - 1:+.0%})")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
