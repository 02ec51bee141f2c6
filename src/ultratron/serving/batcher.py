"""One worker thread owns the model and schedules every request's sequences onto it.

Continuous batching (as vLLM's scheduler does, in its simplest form): between two decode steps
the worker admits waiting sequences into free KV-cache slots and lets finished ones go, so a
short request that arrives while a long generation runs starts at the next token boundary and
finishes first, instead of waiting for the whole batch. `continuous=False` is the fixed-group
policy kept for comparison (benchmarks/serve_throughput.py): admit only when the batch is empty,
run the group to its end.

The queue of waiting sequences is bounded: `submit` raises `QueueFull` when it already holds
`max_queue` of them, and the server answers 429, so overload turns into back-pressure at the
client instead of an ever-growing wait.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable

from ultratron.errors import ConfigError
from ultratron.inference.engine import Engine, Refused, Sequence
from ultratron.inference.paged_kv import PagedCache
from ultratron.models.registry import model_args
from ultratron.serving.metrics import Metrics


def check_kv_memory(model, tokens: int, prefix_cache_bytes: int = 0, block: int = 16) -> int:
    """The bytes the paged KV cache's pool of `tokens` positions takes; ConfigError when that and the
    prefix cache's budget exceed 80 % of the device's memory (GPU: free memory; CPU: physical memory)."""
    import torch

    need = PagedCache.bytes_needed(model, tokens, block)
    device = next(model.parameters()).device
    if device.type == "cuda":
        have, where = torch.cuda.mem_get_info(device)[0], "free on the GPU"
    else:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "of physical memory"
    if need + prefix_cache_bytes > 0.8 * have:
        raise ConfigError(f"the KV cache of {tokens} tokens needs {need / 2**30:.1f} GiB "
                          f"(+ {prefix_cache_bytes / 2**30:.1f} GiB of prefix cache), more than 80% of the "
                          f"{have / 2**30:.1f} GiB {where}; lower --kv-cache-tokens (default: --max-batch × "
                          f"--max-model-len), --prefix-cache-tokens")
    return need


class QueueFull(Exception):
    """The waiting queue is at its bound; retry later."""


class _Job:
    def __init__(self, seqs: list[Sequence], done: Callable[[BaseException | None], None]):
        self.seqs, self.done = seqs, done
        self.remaining = len(seqs)
        self.failed = self.cancelled = False
        self.submitted = time.monotonic()


class Batcher:
    def __init__(self, model, eos_id: int, decode: Callable[[list[int]], str], max_rows: int = 32,
                 max_queue: int = 256, capacity: int | None = None, continuous: bool = True,
                 metrics: Metrics | None = None, **engine_options):
        context = model_args(model).max_seq_len
        capacity = min(capacity or context, context)
        # engine_options: prefix_cache_tokens, cache_top_k, max_batched_tokens, kv_cache_tokens (see Engine)
        self.engine = Engine(model, eos_id, decode, slots=max_rows, capacity=capacity, **engine_options)
        prefix, cache = self.engine.prefix, self.engine.cache
        self.prefix_cache_bytes = 0 if prefix is None else prefix.budget_bytes
        self.kv_tokens = cache.tokens  # the pool's positions: no sequence longer than this is served
        self.kv_bytes = check_kv_memory(model, cache.tokens, self.prefix_cache_bytes, cache.block)
        self.max_queue, self.continuous = max_queue, continuous
        self._cond = threading.Condition()
        self._waiting: deque[tuple[Sequence, _Job]] = deque()
        self._job_of: dict[int, _Job] = {}  # id(sequence) → its job, for the running ones
        self._closed = False
        self._cancelled: list[_Job] = []  # jobs whose client left: their sequences go before the next step
        self._first: dict[int, float] = {}  # id(sequence) → when its first token came
        self.metrics = metrics or Metrics()
        self.steps_run = 0
        # engine steps by how many sequences got a token in them: [0, n1, n2, ...]. Shows whether
        # concurrent requests shared forward passes (one list, updated in place: safe to copy from
        # another thread under the GIL)
        self.rows_per_step = [0] * (max_rows + 1)
        self._thread = threading.Thread(target=self._loop, name="ultratron-batcher", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def stats(self) -> dict:
        """What the worker has done: engine steps, and how many of them ran each batch size."""
        counts = list(self.rows_per_step)
        return {"steps": self.steps_run, "rows_per_step": {str(n): c for n, c in enumerate(counts) if c},
                "running": len(self.engine.rows), "waiting": len(self._waiting), "engine": self.engine.stats()}

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, seqs: list[Sequence], done: Callable[[BaseException | None], None]) -> _Job:
        """Queue sequences; `done(error_or_None)` is called from the worker thread when all have
        finished. Raises QueueFull when `max_queue` sequences are waiting already. Returns the job,
        for `cancel`."""
        job = _Job(seqs, done)
        with self._cond:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} sequences are waiting, the most this server queues")
            self._waiting.extend((s, job) for s in seqs)
            self._cond.notify()
        return job

    def cancel(self, job: _Job) -> None:
        """The job's client is gone (disconnected, timed out): its waiting sequences leave the queue now,
        its running ones before the worker's next decode step; `done` is not called. Any thread."""
        with self._cond:
            if job.cancelled or job.remaining == 0 or job.failed:
                return
            job.cancelled = True
            self._waiting = deque(entry for entry in self._waiting if entry[1] is not job)
            self._cancelled.append(job)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _admissions(self) -> list[tuple[Sequence, _Job]]:
        """Wait for work; then the sequences to admit now (FIFO, as many as there are free slots)."""
        with self._cond:
            while not self._closed and not self._waiting and not self.engine.busy:
                self._cond.wait()
            if self._closed:
                return []
            admit = []
            if self.continuous or not self.engine.busy:
                while self._waiting and len(admit) < self.engine.free:
                    seq, job = self._waiting.popleft()
                    if not (job.failed or job.cancelled):
                        admit.append((seq, job))
            return admit

    def _abort_cancelled(self) -> None:
        with self._cond:
            jobs, self._cancelled = self._cancelled, []
        for job in jobs:
            for seq in self.engine.abort(job.seqs):
                self._job_of.pop(id(seq), None)
                self._account(seq, job)

    def _account(self, seq: Sequence, job: _Job) -> None:
        """Metrics of a sequence that is done: its tokens, time per output token."""
        first = self._first.pop(id(seq), None)
        now = time.monotonic()
        if first is None and seq.tokens:  # finished in the step that gave its first token
            first = now
            self.metrics.first_token(now - job.submitted)
        self.metrics.finished(len(seq.prompt_ids), len(seq.tokens), None if first is None else now - first,
                              seq.finish_reason == "abort")

    def _timing(self) -> None:
        """Time to first token of the running sequences that got theirs in the last step."""
        now = time.monotonic()
        for row in self.engine.rows:
            seq = row.seq
            if seq.tokens and id(seq) not in self._first and (job := self._job_of.get(id(seq))):
                self._first[id(seq)] = now
                self.metrics.first_token(now - job.submitted)

    def _loop(self) -> None:
        while True:
            admit = self._admissions()
            if self._closed:
                return
            self._abort_cancelled()
            finished: list[Sequence] = []
            if admit or self.engine.queue:  # new sequences, or prompts still prefilling (chunks, shared prefixes)
                try:
                    finished = self.engine.admit([s for s, _ in admit])
                    self._job_of.update((id(s), job) for s, job in admit)
                except Refused as err:  # a prompt the engine cannot take: only its requests fail
                    self._fail({id(job): job for _, job in admit}, err)
                except Exception as err:  # a prefill forward failed: so do the prompts it was prefilling
                    jobs = [job for _, job in admit] + [self._job_of.pop(id(s)) for s in self.engine.drop_queue()
                                                        if id(s) in self._job_of]
                    self._fail({id(job): job for job in jobs}, err)
            try:
                if rows := len(self.engine.rows):
                    finished += self.engine.step()
                    self.steps_run += 1
                    self.rows_per_step[rows] += 1
                    self._timing()
            except Exception as err:  # reported to each request it touched; the worker keeps serving
                self._fail({id(job): job for job in self._job_of.values()}, err)
                self._job_of.clear()
                self._first.clear()
                self.engine.clear()
                continue
            for seq in finished:
                job = self._job_of.pop(id(seq))
                self._account(seq, job)
                job.remaining -= 1
                if job.remaining == 0 and not job.failed:
                    job.done(None)

    @staticmethod
    def _fail(jobs: dict[int, _Job], err: BaseException) -> None:
        for job in jobs.values():
            if not job.failed:
                job.failed = True
                job.done(err)
