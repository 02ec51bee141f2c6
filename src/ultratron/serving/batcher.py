"""One worker thread owns the model; requests queue up and run together as one batch."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from ultratron.inference.engine import Sequence, run_batch


class _Job:
    def __init__(self, seqs: list[Sequence], done: Callable[[BaseException | None], None]):
        self.seqs, self.done = seqs, done


class Batcher:
    """Collects the sequences of every waiting request (up to `max_rows`) into one `run_batch`."""

    def __init__(self, model, eos_id: int, decode: Callable[[list[int]], str], max_rows: int = 32):
        self.model, self.eos_id, self.decode, self.max_rows = model, eos_id, decode, max_rows
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self.batches_run = 0
        self.rows_run = 0
        self._thread = threading.Thread(target=self._loop, name="ultratron-batcher", daemon=True)
        self._thread.start()

    def submit(self, seqs: list[Sequence], done: Callable[[BaseException | None], None]) -> None:
        """Queue sequences; `done(error_or_None)` is called from the worker thread when they finish."""
        self._queue.put(_Job(seqs, done))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _take(self) -> list[_Job] | None:
        first = self._queue.get()
        if first is None:
            return None
        jobs, rows = [first], len(first.seqs)
        while rows < self.max_rows:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)
                break
            jobs.append(job)
            rows += len(job.seqs)
        return jobs

    def _loop(self) -> None:
        while (jobs := self._take()) is not None:
            seqs = [s for job in jobs for s in job.seqs]
            error: BaseException | None = None
            try:
                run_batch(self.model, seqs, self.eos_id, self.decode)
                self.batches_run += 1
                self.rows_run += len(seqs)
            except Exception as err:  # reported to each waiting request; the worker keeps serving
                error = err
            for job in jobs:
                job.done(error)
