"""Task evaluation during training, in a separate process, so the training loop never waits.

Every `eval.task_interval` steps the trainer calls `maybe_launch`: the model's weights go into a
small snapshot directory (hard links to the checkpoint's files when one was just saved, so
checkpoint pruning cannot pull them away), and `ultratron eval` starts on it as a child process
at low priority. The loop calls `poll` every step; finished results come back as metric records
with the step they belong to. If an evaluation is still running when the next one is due, the
new one is skipped (and counted); a failing evaluator is logged and forgotten.

With `eval.endpoint` set, the child evaluates through that OpenAI-compatible endpoint instead
(`ultratron eval --endpoint`, with the config's model, key variable, concurrency, timeout,
retries and prices); no weights are written, since the endpoint serves its own model (a
reference model, or a server that follows the run). Its results land in the metrics with the
step that launched them, exactly like local ones, and an unreachable or failing endpoint is
just a failed evaluation: logged, never waited for by the loop.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from ultratron.checkpoint.manager import DONE_MARKER, step_dir_name
from ultratron.evaluation.runner import flat_metrics


class PeriodicEvaluator:
    def __init__(self, cfg, run_dir: Path, log, enabled: bool = True):
        self.cfg, self.log = cfg, log
        self.interval = cfg.eval.task_interval if enabled else 0
        self.dir = Path(run_dir) / "eval"
        self._proc: subprocess.Popen | None = None
        self._step: int | None = None
        self._snapshot: Path | None = None
        self.launched: list[int] = []
        self.skipped: list[int] = []
        self.failed: list[int] = []

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def maybe_launch(self, step: int, model, config_toml: str, tokenizer_json: str,
                     checkpoint: Path | None = None) -> bool:
        """Start an evaluation of `model` at `step` if one is due and none is running."""
        if not self.enabled or step % self.interval:
            return False
        if self._proc is not None:
            self.skipped.append(step)
            self.log(f"eval: step {step} skipped; the evaluation of step {self._step} is still running")
            return False
        e = self.cfg.eval
        out = self.dir / f"{step_dir_name(step)}.json"
        self.dir.mkdir(parents=True, exist_ok=True)
        if e.endpoint:
            snapshot = None
            where = ["--endpoint", e.endpoint, *endpoint_arguments(e)]
        else:
            snapshot = self.dir / "snapshots" / step_dir_name(step)
            self._write_snapshot(snapshot, step, model, config_toml, tokenizer_json, checkpoint)
            where = ["--checkpoint", str(snapshot)]
        cmd = [sys.executable, "-m", "ultratron", "eval", *where, "--tasks", e.tasks,
               "--max-examples", str(e.max_examples), "--json", str(out), "--step", str(step),
               "--threads", "1", "--quiet"]
        logfile = open(self.dir / f"{step_dir_name(step)}.log", "w", encoding="utf-8")
        # A low priority keeps the evaluator from taking CPU time the training loop wants.
        self._proc = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      preexec_fn=lambda: os.nice(10), close_fds=True)
        logfile.close()
        self._step, self._snapshot = step, snapshot
        self.launched.append(step)
        via = f" on {e.endpoint}" if e.endpoint else ""
        self.log(f"eval: started task evaluation of step {step}{via} (pid {self._proc.pid})")
        return True

    def _write_snapshot(self, path: Path, step: int, model, config_toml: str, tokenizer_json: str,
                        checkpoint: Path | None) -> None:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        source = checkpoint / "model.pt" if checkpoint is not None else None
        if source is not None and source.is_file():
            try:
                os.link(source, path / "model.pt")
            except OSError:
                shutil.copyfile(source, path / "model.pt")
        else:
            state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            torch.save(state, path / "model.pt")
        (path / "config.toml").write_text(config_toml, encoding="utf-8")
        (path / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        (path / DONE_MARKER).write_text(f"{step}\n")

    def poll(self) -> list[dict]:
        """Metric records of an evaluation that has finished since the last call (else [])."""
        if self._proc is None or self._proc.poll() is None:
            return []
        step, code = self._step, self._proc.returncode
        self._proc = None
        if self._snapshot is not None:
            shutil.rmtree(self._snapshot, ignore_errors=True)
        out = self.dir / f"{step_dir_name(step)}.json"
        if code != 0 or not out.is_file():
            self.failed.append(step)
            tail = (self.dir / f"{step_dir_name(step)}.log").read_text(encoding="utf-8", errors="replace")[-400:]
            self.log(f"eval: the evaluation of step {step} failed (exit {code}); training goes on. {tail.strip()}")
            return []
        results = json.loads(out.read_text(encoding="utf-8"))["tasks"]
        record = {"step": step, **flat_metrics(results)}
        shown = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in record.items() if k != "step")
        self.log(f"eval: step {step}: {shown}")
        return [record]

    def finish(self, timeout: float, trainer=None, last_checkpoint: Path | None = None) -> list[dict]:
        """At the end of training: wait up to `timeout` s for a running evaluation and collect it;
        if the last step's evaluation was skipped because one was running, run it now."""
        records = self._wait(timeout)
        if trainer is not None and trainer.step in self.skipped:
            self.skipped.remove(trainer.step)
            self.after_step(trainer, _Collect(records), last_checkpoint)
            records += self._wait(timeout)
        return records

    def _wait(self, timeout: float) -> list[dict]:
        if self._proc is not None:
            deadline = time.monotonic() + timeout
            while self._proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if self._proc.poll() is None:
                self.log(f"eval: the evaluation of step {self._step} did not finish within {timeout:.0f} s; "
                         "stopped it")
                self.close()
                return []
        return self.poll()

    def close(self) -> None:
        """Stop a running evaluator (training failed or was interrupted)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc = None
        if self._snapshot is not None:
            shutil.rmtree(self._snapshot, ignore_errors=True)

    def after_step(self, trainer, metrics, last_checkpoint: Path | None) -> None:
        """The trainer's one call per step: record finished results, start a due evaluation."""
        if not self.enabled:
            return
        for record in self.poll():
            metrics.write(record)
        step = trainer.step
        if step % self.interval == 0:
            from ultratron.config import to_toml

            fresh = last_checkpoint if last_checkpoint is not None and last_checkpoint.name == step_dir_name(
                step) else None
            self.maybe_launch(step, trainer.model, to_toml(trainer.cfg), trainer.tokenizer.to_json(), fresh)


def endpoint_arguments(e) -> list[str]:
    """`ultratron eval` options for the endpoint settings of an EvalConfig."""
    args = ["--api-key-env", e.api_key_env, "--concurrency", str(e.concurrency), "--timeout", str(e.timeout),
            "--max-retries", str(e.max_retries), "--price-per-request", str(e.price_per_request),
            "--price-per-1k-prompt-tokens", str(e.price_per_1k_prompt_tokens),
            "--price-per-1k-completion-tokens", str(e.price_per_1k_completion_tokens)]
    return (["--model", e.endpoint_model] if e.endpoint_model else []) + args


class _Collect:
    """Stands in for the metrics writer: keeps records instead of writing them."""

    def __init__(self, records: list[dict]):
        self.records = records

    def write(self, record: dict) -> None:
        self.records.append(record)
