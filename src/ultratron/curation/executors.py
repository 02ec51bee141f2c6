"""Run the pipeline's per-part work on a Ray cluster (`pipeline.executor = "ray"`).

The driver logic (indexes, clustering, cutoffs) stays in the calling process; only the
per-part functions — the same top-level functions the local process pool runs — go to Ray
tasks, so the output is identical to a local run. Parts are read and written through the file
system, which must be shared by all nodes (NFS, or a single machine).
"""

from __future__ import annotations

from collections.abc import Callable

from ultratron.curation.frame import Executor


class RayExecutor(Executor):
    def __init__(self, address: str = "", progress: bool = False, num_cpus: int | None = None):
        import ray

        if not ray.is_initialized():
            kwargs = {"address": address} if address else {"num_cpus": num_cpus, "include_dashboard": False}
            ray.init(ignore_reinit_error=True, log_to_driver=False, **kwargs)
            self._owns = True
        else:
            self._owns = False
        self.progress = progress

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
