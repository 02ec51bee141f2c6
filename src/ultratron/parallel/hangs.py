"""Read the flight records a failed or hung job left in RUN_DIR/flight (parallel/faults.py) and say,
one line per finding, which ranks are behind, in which collective, and which rank never arrived.
Plain JSON (and the NCCL watchdog's
pickled dumps, read as plain values only), no torch: `ultratron doctor` starts at once.

A record holds a rank's last collectives per process group, each with its sequence number in that
group, its op and sizes and when the rank entered it. The ranks of a group call its collectives in
the same order, so within a group:
  - the highest sequence number any rank entered is the collective the job stopped in;
  - a rank whose last entry in the group is lower never arrived there (it is behind);
  - a rank that did enter it, but only after the others had already given up (later than their
    records were written), arrived late: it was the one they waited on, too.
A rank with no record at all was killed before it could write one.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path

FLIGHT_DIR = "flight"
NCCL_DUMP_PREFIX = "nccl-rank-"  # the NCCL watchdog's own dumps on a timeout: nccl-rank-N (pickled)


@dataclass(frozen=True)
class Entry:
    group: str  # the process group's name as PyTorch numbers it, the same on every rank
    desc: str  # its description (default_pg, a mesh dimension's name)
    seq: int  # the collective's sequence number within the group
    op: str
    sizes: list
    entered: float  # seconds since the epoch

    def describe(self) -> str:
        sizes = ", ".join("×".join(str(n) for n in size) or "scalar" for size in self.sizes)
        return f"{self.op} #{self.seq} on group {self.desc or self.group}" + (f" (sizes {sizes})" if sizes else "")


@dataclass
class Record:
    rank: int
    world_size: int
    reason: str
    own_error: bool
    written: float
    entries: list[Entry]


def _entries(flight: dict | None) -> list[Entry]:
    entries = []
    for e in ((flight or {}).get("entries") or []):
        if e.get("is_p2p"):
            continue  # point-to-point sends and receives are numbered apart; collectives tell the order
        name, desc = (list(e.get("process_group") or ["?", ""]) + [""])[:2]
        entries.append(Entry(str(name), str(desc), int(e["collective_seq_id"]), str(e.get("profiling_name", "?")),
                             list(e.get("input_sizes") or []), int(e.get("time_created_ns", 0)) / 1e9))
    return entries


class _PlainValues(pickle.Unpickler):
    """A flight record as the NCCL watchdog pickles it holds dicts, lists, strings and numbers only:
    anything else (a class to import, code to run) is refused, not loaded."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"{module}.{name}: a flight record holds plain values only")


def _nccl_world(flight: dict) -> int:
    """The default group's size, from the dump's process-group table (0 when it does not say)."""
    for group in (flight.get("pg_config") or {}).values():
        if isinstance(group, dict) and group.get("desc") == "default_pg":
            try:
                return len(json.loads(group.get("ranks", "[]")))
            except ValueError:
                return 0
    return 0


def _nccl_record(path: Path) -> Record | None:
    """The record the NCCL watchdog dumped when a collective timed out (`parallel/faults.py`); the
    process ended right after, so the file's time is when the rank gave up."""
    try:
        with open(path, "rb") as fh:
            flight = _PlainValues(fh).load()
        rank = int(path.name[len(NCCL_DUMP_PREFIX):])
    except (OSError, ValueError, pickle.UnpicklingError, EOFError):
        return None
    if not isinstance(flight, dict):
        return None
    return Record(rank, _nccl_world(flight), "NCCL watchdog: a collective timed out", False, path.stat().st_mtime,
                  _entries(flight))


def read_records(run_dir: str | Path) -> list[Record]:
    """Every rank's record: the ones Python wrote (rank-N.json) and, for ranks that left none, the NCCL
    watchdog's (nccl-rank-N)."""
    records = []
    for path in sorted(Path(run_dir, FLIGHT_DIR).glob("rank-*.json")):
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        records.append(Record(int(raw["rank"]), int(raw.get("world_size", 0)), str(raw.get("reason", "")),
                              bool(raw.get("own_error")), float(raw.get("time", 0.0)), _entries(raw.get("flight"))))
    written = {r.rank for r in records}
    for path in sorted(Path(run_dir, FLIGHT_DIR).glob(f"{NCCL_DUMP_PREFIX}*")):
        record = _nccl_record(path)
        if record is not None and record.rank not in written:
            records.append(record)
            written.add(record.rank)
    return records


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def findings(run_dir: str | Path) -> list[str]:
    """One line per finding, most telling first."""
    records = read_records(run_dir)
    if not records:
        return [f"no flight records in {Path(run_dir) / FLIGHT_DIR} (the job wrote none: it did not fail or hang "
                "under ultratron train, or ran on one process)"]
    out, calm = [], []
    world = max(r.world_size for r in records)
    missing = sorted(set(range(world)) - {r.rank for r in records})
    for r in sorted(records, key=lambda r: r.rank):
        if r.own_error:
            out.append(f"rank {r.rank} failed: {r.reason.splitlines()[0][:200]}")
    groups: dict[str, dict[int, list[Entry]]] = {}
    for r in records:
        for e in r.entries:
            groups.setdefault(e.group, {}).setdefault(r.rank, []).append(e)
    for _, by_rank in sorted(groups.items()):
        last = {rank: max(entries, key=lambda e: e.seq) for rank, entries in by_rank.items()}
        top = max(e.seq for e in last.values())
        there = {rank: e for rank, e in last.items() if e.seq == top}
        behind = {rank: e for rank, e in last.items() if e.seq < top}
        stuck = next(iter(there.values()))
        written = {r.rank: r.written for r in records}
        # who entered the last collective only after some rank there had given up and written its record
        gave_up = min(written[rank] for rank in there)
        late = {rank for rank, e in there.items() if e.entered > gave_up}
        waited = sorted(set(there) - late)
        for rank, e in sorted(behind.items()):
            out.append(f"rank {rank} never arrived at {stuck.describe()}: its last collective there was "
                       f"{e.op} #{e.seq}; {_ranks(waited)} waited in it")
        for rank in sorted(late):
            delay = there[rank].entered - min(there[w].entered for w in waited) if waited else 0.0
            out.append(f"rank {rank} arrived at {stuck.describe()} {delay:.0f} s after {_ranks(waited)}, which had "
                       "given up waiting for it")
        if not behind and not late and len(there) > 1:
            calm.append(f"{_ranks(there)} all reached {stuck.describe()}, the last collective recorded on that group: "
                       "none of them is behind there")
    for rank in missing:
        out.append(f"rank {rank} left no flight record (killed before it could write one, or on a host whose "
                   "run directory is not this one)")
    return out or calm  # groups where every rank is level matter only when nothing else stands out
