"""When a rank fails or hangs: the others stop within the collective timeout, say which rank, and
every rank leaves a record of its last collectives for `ultratron doctor`.

- Flight records. PyTorch's flight recorder keeps each rank's last collectives in a ring buffer
  (op, process group, sequence number, sizes, state) for gloo and nccl alike; it is on when
  `TORCH_FR_BUFFER_SIZE` is set before the process group exists (`enable_flight_recorder`). A rank
  writes its buffer to `RUN_DIR/flight/rank-N.json` when training fails on it (a collective timed
  out, a peer went away, its own error) and when it is sent SIGTERM — also while its main thread
  is stuck inside a collective, where no Python signal handler can run: the signal's byte reaches
  a watcher thread through `signal.set_wakeup_fd`, and the recorder is read from there.
- Failure reports. A rank whose own code failed writes one line to the job's store before it
  leaves; a rank whose collective then broke reads it and names that rank in its one error line,
  instead of a socket address. A rank that was killed or hangs reports nothing: then the error
  says so and points at the flight records.
- Leaving. After a failure each rank aborts its process groups (bounded: a group waiting on a
  dead peer is left to the exiting process), so no gloo thread outlives the failure.
- Under NCCL a collective's timeout is seen by the watchdog thread, which dumps the flight record
  to RUN_DIR/flight/nccl-rank-N and ends the process (`process_group_env`): that rank's Python
  never resumes, so the record, not an error line, is its report; a rank whose own code failed
  still reports in Python first (`ParallelDims.fail`), so `ultratron doctor` names it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import torch.distributed as dist

from ultratron.errors import UserError
from ultratron.parallel.hangs import FLIGHT_DIR, NCCL_DUMP_PREFIX

RECORDS = 2000  # collectives kept per rank: a few steps of the largest layouts
_KEY = "ultratron/failed/"
_WAITED_KEY = "ultratron/timed-out/"  # a rank whose own collective timed out (it left the job then)


class DistributedError(UserError):
    """A collective that could not finish because another rank failed, was killed or hangs."""


def process_group_env(device_type: str, run_dir: str | Path | None = None) -> dict[str, str]:
    """What torch's process group reads from the environment when it is created, for a group on
    `device_type`: the flight recorder (gloo and nccl) and, under NCCL, how its watchdog handles a
    collective that timed out or failed. NCCL runs collectives on the GPU's streams, so a timeout is
    seen by the watchdog thread, not by Python: with TORCH_NCCL_ASYNC_ERROR_HANDLING 3 it takes the
    process down (without waiting on communicators that may hang), after dumping the flight record
    to RUN_DIR/flight/nccl-rank-N (TORCH_NCCL_DUMP_ON_TIMEOUT), which `ultratron doctor` reads
    beside the records Python writes (`parallel/hangs.py`)."""
    env = {"TORCH_FR_BUFFER_SIZE": str(RECORDS)}
    if device_type == "cuda":
        env |= {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_TRACE_BUFFER_SIZE": str(RECORDS),
                "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
        if run_dir is not None:  # (torch appends the rank)
            env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(Path(run_dir) / FLIGHT_DIR / NCCL_DUMP_PREFIX)
    return env


_SET_HERE: dict[str, str] = {}  # what enable_flight_recorder set (a later run in the process sets its own)


def enable_flight_recorder(device_type: str = "cpu", run_dir: str | Path | None = None) -> dict[str, str]:
    """Before the process group is created: `process_group_env` set where the user has not set it
    otherwise (their value wins); returns the values in effect."""
    applied = {}
    for name, value in process_group_env(device_type, run_dir).items():
        if os.environ.get(name, _SET_HERE.get(name)) == _SET_HERE.get(name):  # unset, or set by an earlier run
            os.environ[name] = _SET_HERE[name] = value
        applied[name] = os.environ[name]
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in applied:
        Path(applied["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]).parent.mkdir(parents=True, exist_ok=True)
    return applied


def flight_record() -> dict | None:
    """This rank's flight recorder as PyTorch dumps it, or None where this build has none."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json
    except ImportError:
        return None
    try:
        return json.loads(_dump_fr_trace_json(True, False))
    except RuntimeError:  # no recorder registered (buffer size 0)
        return None


def dump(run_dir: str | Path, rank: int, world_size: int, reason: str, own_error: bool = False) -> Path:
    """Write this rank's flight record (and why) to RUN_DIR/flight/rank-N.json; returns the path.
    `own_error`: the reason is this rank's own failure, not a collective that broke under it."""
    out = Path(run_dir) / FLIGHT_DIR
    out.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "world_size": world_size, "host": socket.gethostname(), "pid": os.getpid(),
              "reason": reason, "own_error": own_error, "time": time.time(), "flight": flight_record()}
    path = out / f"rank-{rank}.json"
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(tmp, path)
    return path


class SignalWatch:
    """On SIGTERM (the launcher stopping the job): dump the flight record, then exit 143. Works while
    the main thread is blocked in a collective (see the module docstring). `close` restores what was
    there before (a process may run several trainings)."""

    def __init__(self, run_dir: str | Path, rank: int, world_size: int):
        self.args = (run_dir, rank, world_size)
        self._once = threading.Lock()
        self._previous = self._previous_fd = None
        self._read = self._write = None

    def start(self) -> SignalWatch:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous = signal.signal(signal.SIGTERM, lambda signum, frame: self._stop(signum))
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="ultratron-sigterm", daemon=True).start()
        return self

    def _watch(self) -> None:
        read = self._read
        while True:
            data = os.read(read, 64)
            if signal.SIGTERM in data:
                self._stop(signal.SIGTERM)
            if not data or 0 in data:  # `close` wrote 0 (no signal has number 0): this thread closes its end
                os.close(read)
                return

    def _stop(self, signum: int) -> None:
        if self._once.acquire(blocking=False):
            try:
                dump(*self.args, reason=signal.Signals(signum).name)
            finally:
                os._exit(128 + signum)

    def close(self) -> None:
        if self._read is None:
            return
        signal.set_wakeup_fd(self._previous_fd if self._previous_fd is not None else -1)
        signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        # wake the watcher so that it closes the read end itself: closing it here would leave the
        # thread blocked on a descriptor number the process may reuse for something else
        os.write(self._write, b"\0")
        os.close(self._write)
        self._read = None


def is_collective_error(err: BaseException) -> bool:
    """Whether `err` is a collective that broke (a peer gone, a timeout) rather than this rank's own fault."""
    if isinstance(err, (TimeoutError, *([dist.DistError] if hasattr(dist, "DistError") else []))):
        return True  # (TimeoutError: torchft's RPCs between replica groups)
    text = str(err)
    return isinstance(err, RuntimeError) and any(k in text for k in (
        "gloo", "Gloo", "NCCL", "Connection closed", "Connection reset", "Timed out", "timed out", "Socket"))


def job_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def report_failure(rank: int, err: BaseException) -> None:
    """This rank's own error, in one line, where the other ranks will look for it."""
    store = job_store()
    if store is None:
        return
    line = f"{type(err).__name__}: {err}".splitlines()[0][:300] if str(err) else type(err).__name__
    try:
        store.set(f"{_KEY}{rank}", line)
    except Exception:  # noqa: BLE001 - the store's host may be gone too; the report is best effort
        pass


def _from_store(store, world_size: int) -> dict[int, str]:
    try:
        return {r: store.get(f"{_KEY}{r}").decode() for r in range(world_size) if store.check([f"{_KEY}{r}"])}
    except Exception:  # noqa: BLE001 - a store whose host died (rank 0 under env://) answers nothing
        return {}


def _from_dumps(run_dir: str | Path, since: float) -> dict[int, str]:
    """Own errors in this attempt's flight records: a failing process closes its sockets only when it
    exits, and under env:// rendezvous rank 0's exit takes the store with it, so the record is the
    report that outlives both."""
    found = {}
    for path in Path(run_dir, FLIGHT_DIR).glob("rank-*.json"):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if record.get("own_error") and record.get("time", 0) >= since:
            found[int(record["rank"])] = record["reason"].splitlines()[0][:300]
    return found


def note_timeout(rank: int) -> None:
    """Tell the other ranks this rank's collective timed out: it leaves now, and the ranks whose
    collectives then break on its closed connections say why instead of blaming it."""
    store = job_store()
    try:
        if store is not None:
            store.set(f"{_WAITED_KEY}{rank}", "1")
    except Exception:  # noqa: BLE001 - best effort, as report_failure
        pass


def noted_timeouts(world_size: int, wait: float = 3.0) -> list[int]:
    """Ranks whose collective timed out (`note_timeout`), waiting up to `wait` s for the first."""
    store, deadline = job_store(), time.monotonic() + wait
    while store is not None:
        try:
            found = [r for r in range(world_size) if store.check([f"{_WAITED_KEY}{r}"])]
        except Exception:  # noqa: BLE001 - the store's host may be gone
            return []
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)
    return []


def reported_failures(world_size: int, run_dir: str | Path, since: float, wait: float = 3.0) -> dict[int, str]:
    """The failures other ranks reported since `since` ({rank: line}), waiting up to `wait` s."""
    store = job_store()
    deadline = time.monotonic() + wait
    while True:
        found = (_from_store(store, world_size) if store is not None else {}) | _from_dumps(run_dir, since)
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def leave_after_failure(wait: float = 10.0) -> None:
    """Abort every process group, giving up after `wait` s. Abort, not destroy: destroying waits for
    the group's pending work, which after a failure may wait on a peer that is gone (an NCCL
    communicator then hangs), while aborting drops it and frees the communicators (gloo's too)."""
    if not dist.is_initialized():
        return
    done = threading.Thread(target=dist.distributed_c10d._abort_process_group, name="ultratron-leave", daemon=True)
    done.start()
    done.join(wait)


def _gist(err: BaseException) -> str:
    """The first sentence of a backend's error, without its source location ("[.../pair.cc:553] ")."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". ")[0].rstrip(".")[:200]


def failure_error(err: BaseException, rank: int, world_size: int, timeout: float, run_dir: str | Path,
                  since: float) -> UserError:
    """The one line a rank whose collective broke stops with: which rank failed, if one said so."""
    first = _gist(err)
    timed_out = "timed out" in first.lower() or "timeout" in first.lower()
    if timed_out:  # before anything else: this rank's sockets close when it leaves
        note_timeout(rank)
    # one wait (up to 3 s) for either a peer's own error or a peer's timeout note, not one after the other
    deadline = time.monotonic() + 3.0
    while True:
        reports = reported_failures(world_size, run_dir, since, wait=0.0)
        noted = [] if timed_out else [r for r in noted_timeouts(world_size, wait=0.0) if r != rank]
        if reports or noted or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if reports:
        who = "; ".join(f"rank {r} failed ({line})" for r, line in sorted(reports.items()))
        return DistributedError(f"{who}; rank {rank} stopped: its collective could not finish without it")
    # Ranks do not time out at the same instant: the first to leave breaks the others' collectives,
    # which then see a closed connection rather than their own timeout.
    waited = noted
    if timed_out:
        why = f"a collective waited parallel.collective_timeout = {timeout:g} s for a rank that never arrived"
    elif waited:
        why = (f"rank {waited[0]}'s collective waited parallel.collective_timeout = {timeout:g} s for a rank "
               f"that never arrived, and its leaving broke this rank's")
    else:
        why = "a peer process ended without reporting an error (killed, or out of memory?)"
    return DistributedError(f"rank {rank}: {why} ({first}); every rank's last collectives are in "
                            f"{Path(run_dir) / FLIGHT_DIR}: `ultratron doctor {run_dir}` names the rank")
