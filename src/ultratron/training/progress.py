"""How a run reports: messages to the console and RUN/train.log, one metrics record per step to
metrics.jsonl (and TensorBoard, Weights & Biases), and progress — a tqdm bar on a terminal, plain log lines every
`training.log_interval` steps otherwise (CI, nohup, Slurm logs), so a log file holds no `\\r` frames.
Only rank 0 reports; the other ranks' reporter drops everything."""

from __future__ import annotations

import sys
from pathlib import Path

from ultratron.training.metrics import MetricsWriter, RunLog


class Reporter:
    def __init__(self, run_dir: Path, *, is_main: bool, tensorboard: bool, progress: bool, log_interval: int,
                 echo: bool = True, run_cfg=None, config: dict | None = None):
        self.active = is_main
        self._run_dir = run_dir
        self.log_interval = log_interval
        self.use_bar = progress and echo and sys.stderr.isatty()
        self._log = RunLog(run_dir, echo=echo) if is_main else None
        self._metrics = MetricsWriter(run_dir, tensorboard, run_cfg, config) if is_main else None
        self._bar = None

    def __call__(self, message: str) -> None:
        """One message line (console and train.log)."""
        if self._log is not None:
            self._log(message, self._bar.write if self._bar is not None else None)

    def start(self, first_step: int, last_step: int) -> None:
        if self.active and self.use_bar and first_step < last_step:
            from tqdm import tqdm

            self._bar = tqdm(total=last_step, initial=first_step, desc="train", unit="step", dynamic_ncols=True)

    def record(self, record: dict) -> None:
        """A metrics record (a step's, or evaluation results at their step)."""
        if self._metrics is not None:
            self._metrics.write(record)

    def rewind(self, last_step: int) -> None:
        """Forget the metrics records after `last_step` (steps a rollback discards), and take the bar
        back to it: the steps after it run again, and counting them twice would pass the total."""
        if self._metrics is not None:
            self._metrics.rewind(self._run_dir, last_step)
        if self._bar is not None:
            self._bar.update(last_step - self._bar.n)  # tqdm takes a negative update
            self._bar.refresh()

    def event(self, kind: str, step: int, **data) -> None:
        """A run event (a saved checkpoint, ...) for the trackers that show events."""
        if self._metrics is not None:
            self._metrics.event(kind, step, **data)

    def step(self, record: dict) -> None:
        """A training step's record: written, and shown as progress."""
        self.record(record)
        if not self.active:
            return
        if self._bar is not None:
            self._bar.update(1)
            counted = {"loss_tok_s": f"{record['loss_tokens_per_sec']:,.0f}"} if "loss_tokens" in record else {}
            self._bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}",
                                  tok_s=f"{record['tokens_per_sec']:,.0f}", mfu=f"{record['mfu']:.0%}", **counted)
        elif self.log_interval > 0 and record["step"] % self.log_interval == 0:
            masked = "loss_tokens" in record  # then tok/s and mfu count every position, and the loss's are added
            line = (f"step {record['step']}: loss {record['loss']:.4f} grad_norm {record['grad_norm']:.3f} "
                    f"lr {record['lr']:.2e} {record['tokens_per_sec']:,.0f} {'positions' if masked else 'tok'}/s "
                    f"mfu {record['mfu']:.1%}")
            if masked:
                line += (f"; in the loss {record['loss_tokens']:,} tokens ({record['loss_tokens_total']:,} so far), "
                         f"{record['loss_tokens_per_sec']:,.0f}/s, mfu {record['loss_tokens_mfu']:.1%}")
            if "data/fetched_bytes" in record:  # shards read from an object store (data/remote.py)
                hits, asked = record["data/cache_hits"], record["data/cache_hits"] + record["data/cache_misses"]
                fetched = record["data/fetched_bytes"] / 2**20
                line += f"; data fetched {fetched:,.1f} MiB, cache hits {hits:,} of {asked:,}"
            self(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._log is not None:
            self._log.close()
            self._log = None
