"""Where the per-part work runs: a local process pool, or Ray tasks (`pipeline.executor`).

An executor maps a picklable top-level function over a list of tasks and returns the results
in task order. Only per-part work goes through it; the driver logic of a stage (indexes,
clustering, cutoffs) stays in the calling process, so the output of every executor is the same.

Without a shared file system (`pipeline.shared_fs = false`, which an object-store output sets),
Ray tasks get their files through Ray instead: the driver sends the files a task names under the
output directory, the task runs on a temporary copy of that tree, and the files it wrote come back
to the driver, which writes them in place (`_shipped`).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from ultratron.atomic import write_bytes
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

    def __init__(self, address: str = "", ship_root: str | None = None):
        import ray  # only a Ray run needs it: ray is an optional dependency

        self.ship_root = ship_root  # no shared file system: files under it travel with the tasks

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
        if self.ship_root is None:
            remote = ray.remote(fn)
            return ray.get([remote.remote(task) for task in tasks])
        root = str(Path(self.ship_root).resolve())
        remote = ray.remote(_shipped)
        results = []
        for result, files in ray.get([remote.remote(fn, task, root, _inputs(task, root)) for task in tasks]):
            for rel, data in files.items():
                (Path(root) / rel).parent.mkdir(parents=True, exist_ok=True)
                write_bytes(Path(root) / rel, data)
            results.append(result)
        return results

    def close(self) -> None:
        import ray

        if self._owns and ray.is_initialized():
            ray.shutdown()


def _rewrite(value, old: str, new: str):
    """`value` with every string path under `old` moved under `new` (in tuples, lists, dicts and
    dataclasses, such as a task and its config)."""
    if isinstance(value, str):
        return new + value[len(old):] if value == old or value.startswith(old + os.sep) else value
    if isinstance(value, tuple | list):
        return type(value)(_rewrite(v, old, new) for v in value)
    if isinstance(value, dict):
        return {k: _rewrite(v, old, new) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _rewrite(getattr(value, f.name), old, new)
                                             for f in dataclasses.fields(value) if f.init})
    return value


def _inputs(task, root: str) -> dict[str, bytes | None]:
    """The files under `root` that `task` names, by path relative to it, with their bytes; and the
    directories it names or writes into, with their subdirectories (None), for the task to find."""
    found: dict[str, bytes | None] = {}

    def visit(value) -> None:
        if isinstance(value, str) and value.startswith(root + os.sep):
            if os.path.isfile(value):
                found[os.path.relpath(value, root)] = Path(value).read_bytes()
            folder = Path(value) if os.path.isdir(value) else Path(value).parent
            for d in [folder, *(p for p in folder.iterdir() if p.is_dir())] if folder.is_dir() else []:
                found.setdefault(os.path.relpath(d, root), None)
        elif isinstance(value, tuple | list):
            for v in value:
                visit(v)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                visit(getattr(value, f.name))

    visit(task)
    return found


def _shipped(fn: Callable, task, root: str, inputs: dict[str, bytes | None]):
    """Run `fn(task)` on a Ray worker over a private copy of the files it needs; returns its result
    and the files it wrote, by path relative to `root`."""
    with tempfile.TemporaryDirectory(prefix="ultratron-task-") as work:
        for rel, data in inputs.items():
            if data is None:
                (Path(work) / rel).mkdir(parents=True, exist_ok=True)
            else:
                (Path(work) / rel).parent.mkdir(parents=True, exist_ok=True)
                (Path(work) / rel).write_bytes(data)
        result = fn(_rewrite(task, root, work))
        written = {p.relative_to(work).as_posix(): p.read_bytes() for p in sorted(Path(work).rglob("*"))
                   if p.is_file() and p.relative_to(work).as_posix() not in inputs}
        return _rewrite(result, work, root), written


def make_executor(cfg: DataPipelineConfig) -> Executor:
    if cfg.pipeline.executor == "ray":
        return RayExecutor(cfg.pipeline.ray_address, None if cfg.pipeline.shared_fs else cfg.pipeline.output)
    return LocalExecutor(cfg.pipeline.workers, cfg.pipeline.progress)
