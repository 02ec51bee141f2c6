"""The collective check: do the simulated ranks issue matching collectives? Torch-free.

Each rank's record is its collectives in the order it issued them, one dict each: `op` (all_reduce,
all_gather, reduce_scatter, broadcast, all_to_all, send, recv, ...), `group` (the global ranks of the
process group), `shape`, `dtype`, and for a send or receive `peer` (the other end's global rank).
Two rules, each checked among the ranks that were simulated:
  * within a process group every member issues the same collectives (op, shape, dtype), in the same
    order, as many times;
  * the k-th send from rank a to rank b meets the k-th receive on b from a, of the same shape and dtype.
A mismatch is a hang (or garbage) at launch; the first one found is described in one line.
"""

from __future__ import annotations

P2P = ("send", "recv")


def _describe(call: dict | None) -> str:
    if call is None:
        return "nothing (its sequence ends here)"
    shape = "×".join(str(s) for s in call["shape"]) or "scalar"
    peer = f" {'to' if call['op'] == 'send' else 'from'} rank {call['peer']}" if call["op"] in P2P else ""
    return f"{call['op']} {call['dtype']}[{shape}]{peer}"


def _same(a: dict, b: dict) -> bool:
    return a["op"] == b["op"] and list(a["shape"]) == list(b["shape"]) and a["dtype"] == b["dtype"]


def first_mismatch(records: dict[int, list[dict]]) -> str | None:
    """The first mismatch among the simulated ranks' records (rank → calls), as one line; None when
    every group's members agree and every send meets its receive."""
    ranks = sorted(records)
    # collectives: per group, each simulated member's calls in that group, in order
    per_group: dict[tuple[int, ...], dict[int, list[tuple[int, dict]]]] = {}
    for rank in ranks:
        for number, call in enumerate(records[rank]):
            if call["op"] in P2P:
                continue
            per_group.setdefault(tuple(call["group"]), {}).setdefault(rank, []).append((number, call))
    for group, members in sorted(per_group.items()):
        present = [r for r in group if r in records]
        if len(present) < 2:
            continue
        first = present[0]
        for other in present[1:]:
            a, b = members.get(first, []), members.get(other, [])
            for k in range(max(len(a), len(b))):
                ca, cb = (a[k] if k < len(a) else None), (b[k] if k < len(b) else None)
                if ca is None or cb is None or not _same(ca[1], cb[1]):
                    return (f"collective mismatch in group {list(group)}: call {k + 1} in the group "
                            f"(rank {first}'s call #{ca[0] + 1 if ca else len(records[first]) + 1}, rank {other}'s "
                            f"#{cb[0] + 1 if cb else len(records[other]) + 1}): rank {first} "
                            f"{_describe(ca[1] if ca else None)}, rank {other} {_describe(cb[1] if cb else None)}")
    # point to point: the k-th send a → b against the k-th receive on b from a
    sends: dict[tuple[int, int], list[tuple[int, dict]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, dict]]] = {}
    for rank in ranks:
        for number, call in enumerate(records[rank]):
            if call["op"] == "send":
                sends.setdefault((rank, call["peer"]), []).append((number, call))
            elif call["op"] == "recv":
                recvs.setdefault((call["peer"], rank), []).append((number, call))
    for src, dst in sorted(set(sends) | set(recvs)):
        if src not in records or dst not in records:
            continue
        out, into = sends.get((src, dst), []), recvs.get((src, dst), [])
        for k in range(max(len(out), len(into))):
            s, r = (out[k] if k < len(out) else None), (into[k] if k < len(into) else None)
            if s is None or r is None or list(s[1]["shape"]) != list(r[1]["shape"]) or s[1]["dtype"] != r[1]["dtype"]:
                return (f"point-to-point mismatch from rank {src} to rank {dst}: send {k + 1} "
                        f"(rank {src}'s call #{s[0] + 1 if s else '-'}) is {_describe(s[1] if s else None)}, "
                        f"receive {k + 1} (rank {dst}'s call #{r[0] + 1 if r else '-'}) is "
                        f"{_describe(r[1] if r else None)}")
    return None


def bytes_by_op(calls: list[dict]) -> dict[str, int]:
    """Bytes this rank hands to each kind of collective (each call's tensor bytes, summed)."""
    out: dict[str, int] = {}
    for call in calls:
        out[call["op"]] = out.get(call["op"], 0) + call["bytes"]
    return dict(sorted(out.items()))
