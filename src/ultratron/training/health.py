"""Health checks, and the trainer's monitor that runs them: before the first step and every
`health.interval` minutes every rank checks its GPU (NVML) and times a matmul and an all-reduce;
rank 0 logs the group's verdict, names a straggler (slower than `health.straggler_factor` × the
others' median), and records the timings in the metrics. A failing GPU is named in the log and in
RUN_DIR/unhealthy-nodes.txt (which the Slurm script excludes when it resubmits the job) and, with
`health.stop_on_failure`, stops training. `ultratron health` runs the node's part alone on each
node of a Slurm job before torchrun starts (cli/health.py).

GPU (nvidia-ml-py, `import pynvml`): uncorrected ECC errors, pages pending retirement, row-remap
failures or pending remaps, temperature, hardware clock slowdowns, and XID events. Which XIDs
mean a GPU needs attention follows NVIDIA's XID catalogue: 48 (double-bit ECC), 63/64 (page
retirement or row remap recorded/failed), 74 (NVLink), 79 (fallen off the bus), 92 (high
single-bit ECC rate), 94/95 (contained/uncontained ECC). XIDs arrive only as events, so only
those after the monitor registered are seen. Without a GPU (or NVML) the GPU part says
"no GPU" and the timing checks still run.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ultratron.errors import DeviceError

CRITICAL_XIDS = {48: "double-bit ECC error", 63: "page retirement / row remap recorded",
                 64: "page retirement / row remap failed", 74: "NVLink error", 79: "GPU fell off the bus",
                 92: "high single-bit ECC error rate", 94: "contained ECC error", 95: "uncontained ECC error"}


@dataclass
class GpuHealth:
    """What NVML says about this node's GPUs: `problems` fail the check, `warnings` are only logged."""

    available: bool
    summary: str
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _uuid(text: str) -> str:
    """A GPU UUID as NVML ("GPU-5a8f...") and torch (without the prefix) spell it, in one form."""
    text = str(text).strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def _bus(text: str) -> str:
    """A PCI bus id in NVML's form, domain:bus:device.function with an 8-digit domain ("00000000:3b:00.0")."""
    parts = str(text).strip().lower().split(":")
    if len(parts) == 2:  # bus:device.function, no domain
        parts = ["0", *parts]
    try:
        return f"{int(parts[0], 16):08x}:{int(parts[1], 16):02x}:{parts[2]}"
    except (ValueError, IndexError):
        return str(text).strip().lower()


def nvml_index(ordinal: int, nvml_devices: list[tuple[str, str]], *, uuid: str | None = None,
               bus_id: str | None = None, visible: str | None = None) -> int | None:
    """The NVML index of the GPU that CUDA calls `ordinal` in this process. NVML numbers every GPU of
    the node (in PCI order); CUDA only the visible ones (CUDA_VISIBLE_DEVICES, which Slurm sets when
    it binds GPUs to a task), in its own order. So the ordinal is matched by identity: the GPU's UUID,
    else its PCI bus id (both of which torch reports for the CUDA device), else the ordinal's entry in
    CUDA_VISIBLE_DEVICES (an NVML index, or a UUID or its unique prefix). None: no GPU of NVML's
    matches (the ordinal alone would name another job's GPU). `nvml_devices`: (UUID, PCI bus id) of
    each NVML index."""
    if uuid:
        found = [i for i, (u, _) in enumerate(nvml_devices) if _uuid(u) == _uuid(uuid)]
        if found:
            return found[0]
    if bus_id:
        found = [i for i, (_, b) in enumerate(nvml_devices) if _bus(b) == _bus(bus_id)]
        if found:
            return found[0]
    if visible is None:
        return ordinal if ordinal < len(nvml_devices) else None
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if ordinal >= len(entries):
        return None
    entry = entries[ordinal]
    if entry.isdigit():
        return int(entry) if int(entry) < len(nvml_devices) else None
    found = [i for i, (u, _) in enumerate(nvml_devices) if _uuid(u).startswith(_uuid(entry))]
    return found[0] if len(found) == 1 else None


def cuda_identity(ordinal: int) -> tuple[str | None, str | None]:
    """(UUID, PCI bus id) of CUDA device `ordinal` as torch reports them (None where it does not)."""
    props = torch.cuda.get_device_properties(ordinal)
    uuid = getattr(props, "uuid", None)
    bus = None
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    return (str(uuid) if uuid is not None else None), bus


class GpuMonitor:
    """NVML, opened once: XID events are only delivered to an event set registered beforehand.
    `indices`: NVML's; `cuda_device`: a CUDA ordinal of this process instead, whose NVML index is
    found by identity (`nvml_index`)."""

    def __init__(self, indices: list[int] | None = None, cuda_device: int | None = None):
        self.nvml, self.error, self.handles, self.events = None, None, [], None
        try:
            import pynvml

            pynvml.nvmlInit()
        except ImportError:
            self.error = "nvidia-ml-py is not installed"
            return
        except Exception as err:  # pynvml.NVMLError_LibraryNotFound and others: no driver, no GPU
            self.error = f"NVML unavailable ({err})"
            return
        self.nvml = pynvml
        count = pynvml.nvmlDeviceGetCount()
        if cuda_device is not None:
            index = self.nvml_index_of(cuda_device, count)
            indices = [index] if index is not None else []
            if index is None:
                self.error = f"NVML has no GPU matching CUDA device {cuda_device}"
        chosen = indices if indices is not None else range(count)
        self.handles = [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in chosen if i < count]
        try:
            self.events = pynvml.nvmlEventSetCreate()
            for _, handle in self.handles:
                pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, self.events)
        except Exception:  # not supported (some virtualized GPUs): XIDs go unseen, said in the summary
            self.events = None

    def nvml_index_of(self, cuda_device: int, count: int) -> int | None:
        n = self.nvml
        devices = []
        for i in range(count):
            handle = n.nvmlDeviceGetHandleByIndex(i)
            uuid, pci = self._call(n.nvmlDeviceGetUUID, handle), self._call(n.nvmlDeviceGetPciInfo, handle)
            bus = getattr(pci, "busId", b"") if pci is not None else b""
            devices.append(tuple(v.decode() if isinstance(v, bytes) else str(v or "") for v in (uuid, bus)))
        uuid, bus = cuda_identity(cuda_device)
        return nvml_index(cuda_device, devices, uuid=uuid, bus_id=bus, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except Exception:  # NVMLError_NotSupported on GPUs without the counter
            return None

    def check(self, max_temperature: int) -> GpuHealth:
        if self.nvml is None:
            return GpuHealth(False, f"no GPU: {self.error}")
        if not self.handles:
            return GpuHealth(False, f"no GPU: {self.error or 'NVML sees no device'}")
        n, report = self.nvml, GpuHealth(True, "")
        for index, h in self.handles:
            gpu = f"GPU {index}"
            unc = self._call(n.nvmlDeviceGetTotalEccErrors, h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                             n.NVML_VOLATILE_ECC)
            if unc:
                report.problems.append(f"{gpu}: {unc} uncorrected ECC errors since the driver loaded")
            if self._call(n.nvmlDeviceGetRetiredPagesPendingStatus, h) == n.NVML_FEATURE_ENABLED:
                report.problems.append(f"{gpu}: retired pages pending (needs a GPU reset)")
            rows = self._call(n.nvmlDeviceGetRemappedRows, h)  # (corrected, uncorrected, pending, failure)
            if rows is not None and rows[3]:
                report.problems.append(f"{gpu}: row remapping failed")
            elif rows is not None and rows[2]:
                report.problems.append(f"{gpu}: row remap pending (needs a GPU reset)")
            temp = self._call(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU)
            if temp is not None and temp >= max_temperature:
                report.problems.append(f"{gpu}: {temp} °C, at or above health.max_temperature {max_temperature}")
            reasons = self._call(n.nvmlDeviceGetCurrentClocksEventReasons, h) or 0
            slow = [name for bit, name in ((n.nvmlClocksEventReasonHwSlowdown, "hardware slowdown"),
                                           (n.nvmlClocksEventReasonHwThermalSlowdown, "thermal slowdown"),
                                           (n.nvmlClocksEventReasonHwPowerBrakeSlowdown, "power brake"))
                    if reasons & bit]
            if slow:
                report.warnings.append(f"{gpu}: clocks held back ({', '.join(slow)})")
        report.problems += self._xids()
        seen = "" if self.events is not None else "; XID events not readable here"
        report.summary = f"{len(self.handles)} GPU(s) checked{seen}"
        return report

    def _xids(self) -> list[str]:
        found = []
        while self.events is not None:
            try:
                event = self.nvml.nvmlEventSetWait(self.events, 0)
            except Exception:  # NVML_ERROR_TIMEOUT: no event waiting
                break
            xid = int(event.eventData)
            if xid in CRITICAL_XIDS:
                found.append(f"XID {xid} ({CRITICAL_XIDS[xid]})")
        return found


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_seconds(device: torch.device, size: int, repeats: int = 5) -> float:
    """Median seconds of one size×size matmul (fp32 on CPU, bf16 on GPU), after a warm-up."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    times = []
    for i in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def allreduce_seconds(device: torch.device, numel: int = 1 << 20, repeats: int = 5, group=None) -> float:
    """Median seconds of an all-reduce of `numel` fp32 values; every rank calls it together."""
    x = torch.ones(numel, device=device)
    times = []
    for i in range(repeats + 1):
        dist.barrier(group=group)
        _sync(device)
        start = time.perf_counter()
        dist.all_reduce(x, group=group)
        _sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def others_median(times: list[float], i: int) -> float:
    return statistics.median(times[:i] + times[i + 1:])


def stragglers(times: list[float], factor: float) -> list[int]:
    """Indices whose time exceeds `factor` × the median of the others' (so two ranks can be compared)."""
    if len(times) < 2:
        return []
    return [i for i, t in enumerate(times) if t > factor * others_median(times, i) > 0]


@dataclass
class RankHealth:
    rank: int
    host: str
    matmul_s: float
    allreduce_s: float | None
    gpu: GpuHealth


def check_rank(rank: int, device: torch.device, monitor: GpuMonitor, *, matmul_size: int, max_temperature: int,
               distributed: bool) -> RankHealth:
    size = matmul_size or (4096 if device.type == "cuda" else 256)
    return RankHealth(rank, socket.gethostname(), matmul_seconds(device, size),
                      allreduce_seconds(device) if distributed else None, monitor.check(max_temperature))


def gather(mine: RankHealth) -> list[RankHealth]:
    """Every rank's report, on every rank (one call on every rank)."""
    if not dist.is_initialized():
        return [mine]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def judge(reports: list[RankHealth], factor: float) -> tuple[list[str], list[str], list[str]]:
    """(problems, warnings, failing hosts) of the whole group."""
    problems, warnings, failing = [], [], []
    for r in reports:
        for p in r.gpu.problems:
            problems.append(f"{r.host} rank {r.rank}: {p}")
            failing.append(r.host)
        warnings += [f"{r.host} rank {r.rank}: {w}" for w in r.gpu.warnings]
    for what, times in (("matmul", [r.matmul_s for r in reports]),
                        ("all-reduce", [r.allreduce_s for r in reports if r.allreduce_s is not None])):
        if len(times) == len(reports):
            for i in stragglers(times, factor):
                median = others_median(times, i)
                warnings.append(f"{reports[i].host} rank {reports[i].rank}: straggler: {what} {times[i] * 1e3:.2f} "
                                f"ms, {times[i] / median:.1f}× the other ranks' median {median * 1e3:.2f} ms")
    return problems, warnings, sorted(set(failing))


UNHEALTHY_FILE = "unhealthy-nodes.txt"


class HealthMonitor:
    def __init__(self, cfg, dims, device: torch.device, run_dir: Path, log):
        self.h, self.dims, self.device, self.run_dir, self.log = cfg.health, dims, device, run_dir, log
        gpu = (device.index or 0) if device.type == "cuda" else None  # the CUDA ordinal, not NVML's index
        self.monitor = GpuMonitor(cuda_device=gpu) if (self.h.check or self.h.interval > 0) else None
        self.last = time.monotonic()

    def check(self, step: int, record: bool = True) -> list[str]:
        """Run the checks on every rank (collective); returns the problems found (rank 0 logs them
        and, with `record`, writes a metrics record)."""
        mine = check_rank(self.dims.rank, self.device, self.monitor, matmul_size=self.h.matmul_size,
                          max_temperature=self.h.max_temperature, distributed=self.dims.distributed)
        reports = gather(mine)
        problems, warnings, failing = judge(reports, self.h.straggler_factor)
        matmul = [r.matmul_s for r in reports]
        reduce = [r.allreduce_s for r in reports if r.allreduce_s is not None]
        timing = f"matmul {min(matmul) * 1e3:.2f}–{max(matmul) * 1e3:.2f} ms" + (
            f", all-reduce {min(reduce) * 1e3:.2f}–{max(reduce) * 1e3:.2f} ms" if reduce else "")
        self.log(f"health: step {step}: {len(reports)} rank(s); {reports[0].gpu.summary}; {timing}; "
                 + ("ok" if not problems else f"{len(problems)} problem(s)"))
        for line in warnings:
            self.log(f"health: warning: {line}")
        for line in problems:
            self.log(f"health: FAILED: {line}")
        if record:
            self.log.record({"step": step, "health/matmul_ms_max": max(matmul) * 1e3,
                             "health/problems": len(problems), "health/warnings": len(warnings)}
                            | ({"health/allreduce_ms_max": max(reduce) * 1e3} if reduce else {}))
        if problems:
            if self.dims.is_main:
                with open(self.run_dir / UNHEALTHY_FILE, "a", encoding="utf-8") as fh:
                    fh.write("".join(f"{host}\n" for host in failing))
            if self.h.stop_on_failure:
                raise DeviceError([f"health check failed on {', '.join(failing)} (listed in "
                                   f"{self.run_dir / UNHEALTHY_FILE}):", *problems])
        self.last = time.monotonic()
        return problems

    def before_start(self, step: int) -> None:
        """Before anything else (no metrics record yet: a fresh start trims metrics.jsonl at resume)."""
        if self.h.check:
            self.check(step, record=False)

    def after_step(self, step: int) -> None:
        """The periodic check, when due by rank 0's clock (ranks' clocks differ, so rank 0 decides)."""
        if self.h.interval <= 0:
            return
        due = torch.tensor([float(time.monotonic() - self.last >= self.h.interval * 60)], device=self.device)
        if dist.is_initialized():
            dist.broadcast(due, src=0)
        if due.item():
            self.check(step)
