"""Where the per-part work runs: a local process pool, or Ray tasks (`pipeline.executor`).

An executor maps a picklable top-level function over a list of tasks and returns the results
in task order. Only per-part work goes through it; the driver logic of a stage (indexes,
clustering, cutoffs) stays in the calling process, so the output of every executor is the same.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ultratron.curation.config import DataPipelineConfig
from ultratron.errors import DataError


class Executor:
    """Maps a picklable top-level function over tasks, results in task order."""

    def map(self, fn: Callable, tasks: list, desc: str = "") -> list:
        raise NotImplementedError

    def close(self) -> None:
        pass


class LocalExecutor(Executor):
    def __init__(self, workers: int = 1, progress: bool = False):
        self.workers = workers or os.cpu_count() or 1
        self.progress = progress

    def map(self, fn: Callable, tasks: list, desc: str = "") -> list:
        from tqdm import tqdm

        bar = tqdm(total=len(tasks), desc=desc, unit="part", disable=not self.progress or not tasks)
        if self.workers <= 1 or len(tasks) <= 1:
            results = []
            for task in tasks:
                results.append(fn(task))
                bar.update()
            bar.close()
            return results
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        from concurrent.futures.process import BrokenProcessPool

        # fork: workers inherit the imported modules, so a part starts in milliseconds. The
        # driver starts no threads before the first fork (torch, which does, is imported only
        # inside the perplexity stage, and its workers never call torch).
        ctx = multiprocessing.get_context("fork")
        try:
            with ProcessPoolExecutor(max_workers=min(self.workers, len(tasks)), mp_context=ctx) as pool:
                futures = [pool.submit(fn, task) for task in tasks]
                for fut in futures:
                    fut.add_done_callback(lambda _f: bar.update())
                results = [f.result() for f in futures]
        except BrokenProcessPool:
            # A worker was killed from outside (most often by the kernel, out of memory). Its
            # half-written part was never renamed, so nothing is lost: say how to go on.
            raise DataError(f"{desc or 'pipeline'}: a worker process died (killed by a signal; out of memory?). "
                            "Finished parts are kept: rerun the same command to resume, with fewer "
                            "pipeline.workers or a smaller pipeline.docs_per_part if memory is short") from None
        finally:
            bar.close()
        return results


class RayExecutor(Executor):
    """Ray tasks for the per-part functions, the same ones the local pool runs. Parts are read
    and written through the file system, which all nodes must share (NFS, or one machine)."""

    def __init__(self, address: str = ""):
        import ray  # only a Ray run needs it: ray is an optional dependency

        if not ray.is_initialized():
            kwargs = {"address": address} if address else {"include_dashboard": False}
            ray.init(ignore_reinit_error=True, log_to_driver=False, **kwargs)
            self._owns = True
        else:
            self._owns = False

    def map(self, fn: Callable, tasks: list, desc: str = "") -> list:
        import ray

        if not tasks:
            return []
        remote = ray.remote(fn)
        return ray.get([remote.remote(task) for task in tasks])

    def close(self) -> None:
        import ray

        if self._owns and ray.is_initialized():
            ray.shutdown()


def make_executor(cfg: DataPipelineConfig) -> Executor:
    if cfg.pipeline.executor == "ray":
        return RayExecutor(cfg.pipeline.ray_address)
    return LocalExecutor(cfg.pipeline.workers, cfg.pipeline.progress)
