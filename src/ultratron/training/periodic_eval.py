"""Task evaluation during training, in a separate process, so the training loop never waits.

Every `eval.task_interval` steps `after_step` writes the model's weights into a small snapshot
directory through the checkpoint owner (hard links to the checkpoint's files when one was just
saved, so checkpoint pruning cannot pull them away), and starts `ultratron eval` on it as a child
process at low priority. Each later step collects finished results as metric records with the
step they belong to. If an evaluation is still running when the next one is due, the
new one is skipped (and counted); a failing evaluator is logged and forgotten. Each step's own
record says which evaluation was running while it trained (`eval_running`), so the metrics show
that the loop went on meanwhile.

With `eval.endpoint` set, the child evaluates through that OpenAI-compatible endpoint instead
(`ultratron eval --endpoint`, with flags generated from the config's endpoint settings); no
weights are written, since the endpoint serves its own model (a reference model, or a server that
follows the run). Its results land in the metrics with the
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

from ultratron.checkpoint.manager import CheckpointWriter, ModelState, WriteOptions
from ultratron.checkpoint.store import CheckpointRoot, step_dir_name
from ultratron.config import EndpointConfig
from ultratron.config.loader import settings_from, to_flags


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
        self.stopped: list[int] = []  # evaluations stopped unfinished at the end of training (final_wait)

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    @property
    def evaluating(self) -> int | None:
        """The step whose evaluation's child process is alive now, else None."""
        return self._step if self._proc is not None and self._proc.poll() is None else None

    def _launch(self, step: int, model, files: dict[str, str], checkpoint: Path | None) -> None:
        """Start an evaluation of `model` at `step`, unless one is still running (then it is skipped)."""
        if self._proc is not None:
            self.skipped.append(step)
            self.log(f"eval: step {step} skipped; the evaluation of step {self._step} is still running")
            return
        e = self.cfg.eval
        out = self.dir / f"{step_dir_name(step)}.json"
        self.dir.mkdir(parents=True, exist_ok=True)
        if e.endpoint:
            snap = None
            where = to_flags(settings_from(EndpointConfig, e))
            if self.cfg.data.builtin_corpus:  # the suite from this run's held-out split, as a checkpoint's would be
                where += ["--held-out-fraction", str(self.cfg.data.held_out_fraction)]
        else:
            # a weights-only checkpoint for the child: links to the files of `checkpoint` when it
            # holds this step's weights on local disk (nothing copied), else the live model written out
            snaps = CheckpointRoot(self.dir / "snapshots")
            snap = snaps.path_for(step)
            shutil.rmtree(snap, ignore_errors=True)
            CheckpointWriter(snaps).write(step, ModelState(model), files=files,
                                          options=WriteOptions(link_from=checkpoint)).result()
            where = ["--checkpoint", str(snap)]
        cmd = [sys.executable, "-m", "ultratron", "eval", *where, "--tasks", e.tasks,
               "--max-examples", str(e.max_examples), "--json", str(out), "--step", str(step),
               "--threads", "1", "--quiet"]
        logfile = open(self.dir / f"{step_dir_name(step)}.log", "w", encoding="utf-8")
        # A low priority keeps the evaluator from taking CPU time the training loop wants.
        self._proc = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      preexec_fn=lambda: os.nice(10), close_fds=True)
        logfile.close()
        self._step, self._snapshot = step, snap
        self.launched.append(step)
        via = f" on {e.endpoint}" if e.endpoint else ""
        self.log(f"eval: started task evaluation of step {step}{via} (pid {self._proc.pid})")

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
        record = {"step": step, **json.loads(out.read_text(encoding="utf-8"))["metrics"]}
        shown = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in record.items() if k != "step")
        self.log(f"eval: step {step}: {shown}")
        return [record]

    def finish(self, timeout: float, step: int, model, files: dict[str, str],
               last_checkpoint: Path | None) -> list[dict]:
        """At the end of training: wait up to `timeout` s for a running evaluation and collect it;
        if the last step's evaluation was skipped because one was running, run it now."""
        records = self._wait(timeout)
        if step in self.skipped:
            self.skipped.remove(step)
            self._launch(step, model, files, last_checkpoint)
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
                self.stopped.append(self._step)
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

    def after_step(self, step: int, model, files: dict[str, str], last_checkpoint: Path | None) -> list[dict]:
        """The trainer's one call per step: finished results as records, and a due evaluation started."""
        if not self.enabled:
            return []
        records = self.poll()
        if step % self.interval == 0:
            fresh = last_checkpoint if last_checkpoint is not None and last_checkpoint.name == step_dir_name(
                step) else None
            self._launch(step, model, files, fresh)
        return records
