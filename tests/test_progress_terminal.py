"""The progress bar as a terminal shows it: `ultratron train` on a pseudo-terminal, through a
loss spike that the stability guard rolls back."""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The fault comes from outside the code under test, as in test_resilience.py: the loader serves
# random tokens for the two micro-batches of step 28 (by loader position, so the data a rollback
# skips is never served again). The rest is `ultratron train` as a user runs it.
DRIVER = """
import sys
import torch
from ultratron.training.trainer import Trainer

built = Trainer.__init__

def with_garbage_at_step_28(self, cfg, *args, **kwargs):
    built(self, cfg, *args, **kwargs)
    loader, accum, mbs = self.train_loader, cfg.grad_accum_steps, cfg.training.micro_batch_size
    positions = {(27 * accum + i) * mbs for i in range(accum)}
    real = loader.next_batch

    def next_batch():
        position = loader.consumed  # the global position: unique over epochs
        inputs, targets = real()
        if position in positions:
            seeded = torch.Generator().manual_seed(position)
            noise = torch.randint(0, cfg.model.vocab_size, inputs.shape, generator=seeded)
            return noise, torch.roll(noise, -1, 1)
        return inputs, targets

    loader.next_batch = next_batch

Trainer.__init__ = with_garbage_at_step_28
from ultratron.cli import main
sys.exit(main(["train", *sys.argv[1:]]))
"""


def _run_on_a_terminal(args: list[str], columns: int = 150) -> tuple[int, str]:
    """Run the driver with stdout and stderr on a pseudo-terminal; (exit code, everything it wrote)."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, *args], stdin=subprocess.DEVNULL, stdout=follower,
                            stderr=follower, env=env, close_fds=True)
    os.close(follower)
    out = bytearray()
    deadline = time.monotonic() + 600  # only so a hung run cannot hang the suite; not a speed check
    try:
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 1.0)[0]:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=60), out.decode("utf-8", errors="replace")
    finally:
        proc.kill()
        os.close(leader)


def test_the_progress_bar_on_a_terminal_counts_through_a_rollback(tiny_overrides, tmp_path):
    run = tmp_path / "run"
    code, screen = _run_on_a_terminal(tiny_overrides + [
        "--data.cache_dir", str(tmp_path / "data"), "--run.dir", str(run), "--training.steps", "40",
        "--checkpoint.interval", "5", "--eval.interval", "40", "--eval.batches", "4", "--training.progress", "true"])
    assert code == 0, screen[-3000:]
    # the terminal redraws the bar in place ('\r'); each frame is what one redraw leaves on the line.
    # tqdm draws "train:  68%|███ | 27/40 [...", and past its total "train: 41step [..."
    frames = [f for f in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", screen)) if f.strip()]
    shown = [(i, int(m[1]), m[2]) for i, f in enumerate(frames)
             if (m := re.search(r"^train: .*?(\d+)(/\d+ \[|step \[)", f))]
    assert shown and all(form == "/40 [" for _, _, form in shown), [frames[i] for i, _, _ in shown][-5:]
    rollback = next(i for i, f in enumerate(frames) if "stability: step 28: spike (" in f)
    assert "rolled back to step 25 and skipped the data of steps 26–28" in frames[rollback]
    before = [n for i, n, _ in shown if i < rollback]
    after = [n for i, n, _ in shown if i > rollback]
    assert before == sorted(before) and before[-1] == 27  # step 28 spiked: not counted
    # back to 25 at once (after at most one redraw of the old count), then up to the total, never past it
    back = after.index(25)
    assert back <= 1 and after[back:] == sorted(after[back:]) and after[-1] == 40, after
    assert "100%" in frames[shown[-1][0]]
    assert "trained to step 40" in screen and "Traceback" not in screen
