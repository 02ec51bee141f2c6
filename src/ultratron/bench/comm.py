"""`ultratron bench comm`: measure the collectives a training step issues — all-reduce, all-gather,
reduce-scatter, all-to-all, broadcast and point-to-point — and one rank's matmul and elementwise
(memory) rates, with every rank computing at once and with one rank alone, the CPU cores the
ranks share, and (`bench/kernels.py`) a model's own non-matmul work on one rank, on the
machines it runs on, and write a profile (`planning/profile.py`) that `plan estimate` and `plan
search` read with --profile.

On one machine it starts --nproc processes itself (gloo on a CPU, NCCL with a GPU each); under
torchrun (`ultratron launch` or `torchrun -m ultratron bench comm`) it uses the ranks it is given.
Each operation runs on the whole world (across nodes when the world spans several) and, when it
does, again on the first node's ranks alone, at message sizes from 4 KiB up to --max-bytes; each
size is timed --repeat times after a warm-up, the median kept, the slowest rank's time counted.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from ultratron.bench.timing import seconds_of
from ultratron.models.presets import PRESETS
from ultratron.planning.comm import OPS
from ultratron.planning.profile import FORMAT, fit_kernels, fit_profile, write_profile


def _sizes(max_bytes: int) -> list[int]:
    sizes, size = [], 4096
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    return sizes


def _run_op(op: str, nbytes: int, group, ranks: list[int], device) -> None:
    n = len(ranks)
    elements = max(n, nbytes // 4 // n * n)  # fp32, divisible by the group
    me = dist.get_rank()
    if op == "all-reduce":
        dist.all_reduce(torch.ones(elements, device=device), group=group)
    elif op == "all-gather":
        dist.all_gather_single(torch.empty(elements, device=device),
                                    torch.ones(elements // n, device=device), group=group)
    elif op == "reduce-scatter":
        out = torch.empty(elements // n, device=device)
        if dist.get_backend(group) == "gloo":  # gloo has no reduce_scatter_tensor: sum, keep a shard
            full = torch.ones(elements, device=device)
            dist.all_reduce(full, group=group)
            out.copy_(full[ranks.index(me) * (elements // n):][:elements // n])
        else:
            dist.reduce_scatter_tensor(out, torch.ones(elements, device=device), group=group)
    elif op == "all-to-all":
        dist.all_to_all_single(torch.empty(elements, device=device), torch.ones(elements, device=device), group=group)
    elif op == "broadcast":
        dist.broadcast(torch.ones(elements, device=device), src=ranks[0], group=group)
    elif op == "p2p":  # pairs (0,1), (2,3), ...: each sends its message to its partner and receives one
        partner = ranks[ranks.index(me) ^ 1] if ranks.index(me) ^ 1 < n else me
        if partner != me:
            ops = [dist.P2POp(dist.isend, torch.ones(elements, device=device), partner, group),
                   dist.P2POp(dist.irecv, torch.empty(elements, device=device), partner, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()


def _timed(op: str, nbytes: int, group, ranks: list[int], device, repeat: int) -> float:
    _run_op(op, nbytes, group, ranks, device)  # warm-up
    times = []
    for _ in range(repeat):
        dist.barrier(group=group)
        start = time.perf_counter()
        _run_op(op, nbytes, group, ranks, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)  # the slowest rank sets the pace
        times.append(float(elapsed))
    return statistics.median(times)


def matmul_rate(device, dtype, size: int, repeat: int) -> float:
    """FLOP/s of one (size × size) @ (size × size) product, median of `repeat`."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    return 2 * size**3 / statistics.median(seconds_of(lambda: a @ b, device) for _ in range(repeat))


def memory_rate(device, dtype, nbytes: int, repeat: int) -> float:
    """Bytes/s of an elementwise add over `nbytes` tensors (reads two, writes one), median of `repeat`."""
    n = max(nbytes // torch.empty((), dtype=dtype).element_size(), 1)
    a, b, c = (torch.ones(n, device=device, dtype=dtype) for _ in range(3))
    torch.add(a, b, out=c)
    return 3 * n * a.element_size() / statistics.median(seconds_of(lambda: torch.add(a, b, out=c), device)
                                                        for _ in range(repeat))


def cores_available() -> int:
    """The CPU cores this process may run on (its affinity mask; the machine's count elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _rates(device, dtype, matmul_size: int, repeat: int, alone: bool) -> tuple[float, float]:
    """(matmul FLOP/s, elementwise bytes/s): every rank at once (the slowest), or rank 0 alone while
    the others wait (what one rank gets with the cores to itself)."""
    dist.barrier()
    rates = torch.zeros(2)
    if not alone or dist.get_rank() == 0:
        rates = torch.tensor([matmul_rate(device, dtype, matmul_size, repeat),
                              memory_rate(device, dtype, 64 * 2**20, repeat)])
    if alone:
        dist.broadcast(rates, 0)
    else:
        dist.all_reduce(rates, op=dist.ReduceOp.MIN)
    return float(rates[0]), float(rates[1])


def measure(max_bytes: int, repeat: int, matmul_size: int, kernels: tuple[str, int, int] | None = None) -> dict | None:
    """Run on every rank of an initialised process group; rank 0 gets the profile, the others None.
    `kernels` (model preset, micro-batch, sequence): also time that model's own non-matmul work on
    rank 0 alone (`bench/kernels.py`) and fit the planner's rates to it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    groups = [(list(range(world)), None, world > local)]
    if world > local:
        node = list(range(local))
        groups.append((node, dist.new_group(node), False))
    measurements = []
    for ranks, group, spans in groups:
        if rank not in ranks:
            continue
        for op in OPS:
            if op == "p2p" and len(ranks) < 2:
                continue
            for nbytes in _sizes(max_bytes):
                seconds = _timed(op, nbytes, group, ranks, device, repeat)
                measurements.append({"op": op, "group": 2 if op == "p2p" else len(ranks), "spans_nodes": spans,
                                     "bytes": nbytes, "seconds": seconds})
    dist.barrier()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timed = max(repeat, 10)  # the rates are what a step's compute runs at: more than a few samples
    rate, bandwidth = _rates(device, dtype, matmul_size, timed, alone=False)  # all at once, as in training
    rate_alone, bandwidth_alone = _rates(device, dtype, matmul_size, timed, alone=True)
    measured = None
    if kernels and not rank:  # right after the rates they are fitted against, the others waiting
        from ultratron.bench.kernels import kernel_measurements  # (the model registry: rank 0 alone imports it)

        model, micro_batch, seq = kernels
        paced_by = (matmul_size, rate_alone if device.type == "cpu" else rate)  # the rate the planner uses
        measured = kernel_measurements(model, PRESETS[model], micro_batch, seq, device,
                                       "bf16" if dtype == torch.bfloat16 else "fp32", timed, paced_by)
    dist.barrier()
    if rank:
        return None
    cpu = device.type == "cpu"
    profile = {"format": FORMAT, "version": 1, "device": torch.cuda.get_device_name(device) if not cpu
            else "cpu", "backend": dist.get_backend(), "world_size": world, "gpus_per_node": local,
            "threads_per_rank": torch.get_num_threads(), "matmul_flops": rate, "memory_bw": bandwidth,
            "matmul_flops_alone": rate_alone, "memory_bw_alone": bandwidth_alone,
            # a CPU's ranks share its cores (planning.hardware.Accelerator.core_share); a GPU is its own
            "cores": cores_available() if cpu else 0,
            "dtype": "bf16" if dtype == torch.bfloat16 else "fp32", **fit_profile(measurements),
            "measurements": measurements}
    if measured:
        profile["kernel_measurements"] = measured
        profile.update(fit_kernels(profile))
    return profile


def _worker(rank: int, world: int, init: str, out: str, max_bytes: int, repeat: int, matmul_size: int,
            threads: int, kernels) -> None:
    torch.set_num_threads(threads)
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    _measure_in_group(out, max_bytes, repeat, matmul_size, kernels)


def _measure_in_group(out: str, max_bytes: int, repeat: int, matmul_size: int, kernels) -> None:
    """Measure in the process group this process has joined (rank 0 writes the profile), then leave it."""
    try:
        profile = measure(max_bytes, repeat, matmul_size, kernels)
        if profile is not None:
            write_profile(out, profile)
    finally:
        dist.destroy_process_group()


def run_comm(out: str, nproc: int, max_bytes: int, repeat: int, matmul_size: int, threads: int,
             kernels: tuple[str, int, int] | None = None) -> None:
    """Measure and write the profile: under torchrun with its ranks, else with `nproc` local processes;
    `kernels`: `measure`'s."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        _measure_in_group(out, max_bytes, repeat, matmul_size, kernels)
        return
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/store"
        mp.spawn(_worker, args=(nproc, init, out, max_bytes, repeat, matmul_size, threads, kernels), nprocs=nproc,
                 join=True)
