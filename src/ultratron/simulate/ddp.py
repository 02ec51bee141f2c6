"""A stand-in for `DistributedDataParallel` in a simulated rank: what DDP issues and allocates,
in Python, on fake tensors.

Why: DDP's C++ reducer keeps the parameters it was built with (the meta ones: the simulation
materializes them afterwards, as new tensors) and reads its buckets' data, which fake tensors do
not have. `simulate/rank.py` puts this class in the place of `DistributedDataParallel` in
`parallel/data.py` (its `apply_ddp` builds DDP through that one name), so it is built with the
very arguments the trainer gives DDP and does what torch's reducer does with them (torch 2.13,
`find_unused_parameters=False`, no communication hook):

  * buckets: flat gradient tensors, one per group of parameters of one dtype. The first
    iteration has one bucket of every parameter (torch does no size-bucketing before it knows
    backward's order); the first forward after a synchronised backward rebuilds them in the order
    that backward made the gradients ready, the first bucket up to 1 MiB and the others up to
    `bucket_cap_mb` (25 MiB unless set; both caps `bucket_cap_mb` when it is set), by torch's own
    `_compute_bucket_assignment_by_size`. The new buckets are allocated while the old ones are
    still alive (the gradients are copied over), as torch does.
  * `gradient_as_bucket_view`: each gradient is a view of its bucket (else a copy beside it).
  * in a synchronised backward, each gradient is divided by the group size when it is ready
    (a post-accumulate-grad hook) and a bucket's `all_reduce` (sum) is issued once all its
    gradients are, buckets in order, as torch's reducer launches them; the end of backward waits
    for them. Under `no_sync()` gradients only accumulate.

Not modelled: DDP's construction-time collectives (the parameter-shape check and the broadcast of
rank 0's weights: before the measured step), its buffers' broadcast (the trainer turns it off), the
timing of the launches (nothing overlaps on a fake process group)."""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _DEFAULT_BUCKET_CAP_MB, _MB_TO_BYTES


class StandInDDP(DistributedDataParallel):
    """`DistributedDataParallel(module, ...)` as `parallel/data.py` calls it (a subclass, so that
    `isinstance` checks and `unwrap` see DDP, but none of its C++ state is built)."""

    def __init__(self, module: nn.Module, device_ids=None, forward_sync_buffers: bool = True, process_group=None,
                 gradient_as_bucket_view: bool = False, bucket_cap_mb: float | None = None, **unsupported):
        if unsupported:
            raise TypeError(f"simulate's DDP stand-in does not model {', '.join(sorted(unsupported))}")
        nn.Module.__init__(self)
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.require_backward_grad_sync = True
        cap = _DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        self.bucket_bytes_cap = int(cap * _MB_TO_BYTES)
        self.first_bucket_bytes_cap = dist._DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None \
            else self.bucket_bytes_cap
        self._ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self._params: list[nn.Parameter] = []  # set at the first forward: the materialized parameters
        self.buckets: list[torch.Tensor] = []
        self.bucket_params: list[list[int]] = []  # parameter indices per bucket, in bucket order
        self._ready_order: list[int] = []  # the order the first synchronised backward made them ready
        self._rebuilt = self._record_order = self._queued = False
        self._views: dict[int, torch.Tensor] = {}  # parameter index → its gradient's place in its bucket
        self._bucket_of: dict[int, int] = {}
        self._pending: list[int] = []  # per bucket, its gradients not ready yet in this backward
        self._next = 0  # the next bucket to all-reduce (in order, as torch's reducer does)
        self._works: list = []

    # -- buckets -------------------------------------------------------------------------------
    def _start(self) -> None:
        self._params = [p for name, p in self.module.named_parameters()
                        if p.requires_grad and name not in self._ignored]
        self._build(list(range(len(self._params))), [sys.maxsize], keep_order=False)
        for index, param in enumerate(self._params):
            param.register_post_accumulate_grad_hook(lambda p, i=index: self._ready(i))

    def _build(self, order: list[int], limits: list[int], keep_order: bool) -> None:
        """Buckets over the parameters `order` lists (indices into `_params`), torch's assignment;
        each gradient then lives in (or beside) its new bucket."""
        tensors = [self._params[i] for i in order]
        assigned, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors),
                                                              order if keep_order else [])
        if not keep_order:  # the initial assignment is in registration order; backward runs it reversed
            assigned = [[order[i] for i in bucket] for bucket in reversed(assigned)]
        self.buckets, self.bucket_params = [], [list(b) for b in assigned]
        for indices in self.bucket_params:
            params = [self._params[i] for i in indices]
            flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            offset = 0
            for i, p in zip(indices, params, strict=True):
                self._views[i] = view = flat[offset:offset + p.numel()].view_as(p)
                self._bucket_of[i] = len(self.buckets)
                if p.grad is not None:
                    view.copy_(p.grad)
                if self.gradient_as_bucket_view:
                    p.grad = view
                offset += p.numel()
            self.buckets.append(flat)

    # -- the step ------------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        if not self._params:
            self._start()
        if torch.is_grad_enabled():
            if self._ready_order and not self._rebuilt:
                self._rebuilt = True
                self._build(self._ready_order, [self.first_bucket_bytes_cap, self.bucket_bytes_cap], keep_order=True)
            if self.require_backward_grad_sync:
                self._pending = [len(b) for b in self.bucket_params]
                self._next = 0
                self._record_order = not self._rebuilt and not self._ready_order
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def _ready(self, index: int) -> None:
        """A gradient is final for this backward: average it into its bucket; all-reduce the
        buckets that are complete, in bucket order."""
        if not self.require_backward_grad_sync or not self._pending:
            return
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        if self._record_order:
            self._ready_order.append(index)
        grad, view = self._params[index].grad, self._views[index]
        if view is grad:
            grad.div_(dist.get_world_size(self.process_group))
        else:  # a gradient beside its bucket: copied in (and, with bucket views, a view again)
            torch.div(grad, dist.get_world_size(self.process_group), out=view)
            if self.gradient_as_bucket_view:
                self._params[index].grad = view
        self._pending[self._bucket_of[index]] -= 1
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._works.append(dist.all_reduce(self.buckets[self._next], group=self.process_group, async_op=True))
            self._next += 1

    def _finish(self) -> None:
        """End of a synchronised backward: wait for the buckets' all-reduces (and, without bucket
        views, copy the averaged gradients back)."""
        for work in self._works:
            if work is not None:
                work.wait()
        self._works, self._pending, self._queued = [], [], False
        if not self.gradient_as_bucket_view:
            for index, view in self._views.items():
                self._params[index].grad.copy_(view)
