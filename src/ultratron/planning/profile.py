"""A measured machine profile: what `ultratron bench comm` writes and `plan estimate` / `plan search
--profile FILE` read (torch-free). It holds the links a step's collectives run on — bus bandwidth and
latency per operation, inside a node and, when the run spanned nodes, across — the GPUs per node,
and the measured matmul rate of one rank while all ranks multiply at once.

    {"format": "ultratron-comm-profile", "version": 1, "device": "cpu", "backend": "gloo",
     "world_size": 4, "gpus_per_node": 4, "threads_per_rank": 1, "cores": 2, "dtype": "fp32",
     "matmul_flops": 2.1e10, "memory_bw": 2e9,            (every rank computing at once: the slowest)
     "matmul_flops_alone": 4.1e10, "memory_bw_alone": 4e9, (one rank, the others waiting)
     "intra": {"all-reduce": {"bandwidth": 1.2e9, "latency": 8e-05}, ...},
     "inter": {...} or {},
     "measurements": [{"op", "group", "spans_nodes", "bytes", "seconds"}, ...],
     "kernel_measurements": {"model": "tiny", "shape": {...}, "micro_batch": 8, "seq": 256,
                             "precision": "fp32", "seconds": {"layer", "layer_one_token", "loss",
                             "loss_one_token", "attention", "optimizer"}},  (one rank alone)
     "kernels": {"layer": {"bandwidth": 3e9, "latency": 4e-4}, "loss": {...}, "optimizer": {...}},
     "attention_flops": 1.8e10}

The kernels are the model's own non-matmul work timed on one rank (`bench/kernels.py`), fitted by
`fit_kernels` to the planner's `calls × latency + bytes / bandwidth` (planning.compute) after the
matmuls and attention its compute term prices. A profile without them (an older one) leaves that
work at the memory bandwidth and attention at the matmul rate.

Bandwidth is NCCL tests' bus bandwidth (bytes × the operation's factor in `planning.comm` / time), so
the planner's `bytes × factor / bandwidth + latency` gives back the measured time.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ultratron import atomic
from ultratron.errors import UserError
from ultratron.models.presets import ModelShape
from ultratron.models.specs import spec_of
from ultratron.planning.comm import BUS_FACTORS, OPS, Link, Network
from ultratron.planning.compute import (
    KERNEL_KINDS,
    elementwise_parts,
    layer_matmuls,
    matmul_seconds,
)
from ultratron.planning.hardware import Accelerator, GiB
from ultratron.planning.layout import Layout
from ultratron.planning.memory import estimate_memory

FORMAT = "ultratron-comm-profile"


def fit_link(op: str, group: int, points: list[tuple[float, float]]) -> Link:
    """Latency and bus bandwidth from (bytes, seconds) points of one operation on one group:
    the latency is the smallest message's time, the bandwidth the median over the larger half of
    bytes × factor / (time − latency)."""
    points = sorted(points)
    latency = points[0][1]
    factor = BUS_FACTORS[op](group)
    large = points[len(points) // 2:]
    rates = [b * factor / max(s - latency, 1e-12) for b, s in large]
    return Link(statistics.median(rates), latency)


def fit_profile(measurements: list[dict]) -> dict:
    """{"intra": {op: {"bandwidth", "latency"}}, "inter": {...}} from raw measurements."""
    out: dict = {"intra": {}, "inter": {}}
    for where, spans in (("intra", False), ("inter", True)):
        for op in OPS:
            rows = [m for m in measurements if m["op"] == op and bool(m["spans_nodes"]) == spans]
            if rows:
                link = fit_link(op, rows[0]["group"], [(m["bytes"], m["seconds"]) for m in rows])
                out[where][op] = {"bandwidth": link.bandwidth, "latency": link.latency}
    return out


def write_profile(path: str | Path, profile: dict) -> None:
    atomic.write_text(Path(path), json.dumps(profile, indent=1))


def load_profile(path: str | Path) -> dict:
    """The profile's JSON, checked: a UserError says what is wrong."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read the profile {path}: {err}") from err
    problems = []
    if data.get("format") != FORMAT:
        problems.append(f"{path} is not an `ultratron bench comm` profile (format {data.get('format')!r})")
    elif not data.get("intra") and not data.get("inter"):
        problems.append(f"{path} holds no link measurements")
    if problems:
        raise UserError(problems)
    return data


def _links(table: dict) -> tuple[Link | None, dict]:
    ops = {op: Link(v["bandwidth"], v["latency"]) for op, v in table.items() if op in OPS}
    if not ops:
        return None, {}
    # the link's own figure (for an operation not measured): all-reduce's, else the slowest measured
    base = ops.get("all-reduce") or min(ops.values(), key=lambda link: link.bandwidth)
    return base, ops


def network_of_profile(profile: dict, gpus_per_node: int | None = None) -> Network:
    """The planner's links from a profile; a profile measured on one node uses its intra-node links
    across nodes too (and says so in `profile_note`)."""
    intra, intra_ops = _links(profile.get("intra", {}))
    inter, inter_ops = _links(profile.get("inter", {}))
    intra = intra or inter
    intra_ops = intra_ops or inter_ops
    return Network(gpus_per_node or profile.get("gpus_per_node", 8), intra, inter or intra, intra_ops,
                   inter_ops or intra_ops)


def profile_note(profile: dict) -> str:
    if not profile.get("inter"):
        return "the profile was measured on one node: groups across nodes are priced at its intra-node links"
    return ""


def planner_rates(profile: dict) -> tuple[float, float]:
    """(matmul FLOP/s, memory bytes/s) the planner computes at under this profile: on a CPU that
    recorded its cores, the rates of one rank alone (divided later by the layout's share of the
    cores), else those every rank reached at once."""
    rate = profile.get("matmul_flops")
    if not rate:
        raise UserError("the profile has no measured matmul rate (matmul_flops): give --gpu as well")
    bandwidth = profile.get("memory_bw", 3.35e12)
    if int(profile.get("cores") or 0) and profile.get("matmul_flops_alone"):
        return profile["matmul_flops_alone"], profile.get("memory_bw_alone", bandwidth)
    return rate, bandwidth


def fit_kernels(profile: dict) -> dict:
    """{"kernels": {kind: {"bandwidth", "latency"}}, "attention_flops"} from the profile's
    `kernel_measurements` and its matmul rate: attention's model FLOPs (12·s·h per token and layer)
    over its time; for "layer" and "loss" the time left after the products the compute term prices
    (a block's, the head's: `matmul_seconds` at the planner's rates), the one-token run's rest being
    the latency and the full run's bytes (`planning.compute`'s count) over the rest after it the
    bandwidth; the optimizer's bytes over its time. A rest not above zero (noise) leaves the kind at
    the memory bandwidth."""
    m = profile["kernel_measurements"]
    shape, b, s, times = ModelShape(**m["shape"]), m["micro_batch"], m["seq"], m["seconds"]
    rate, bandwidth = planner_rates(profile)
    layout = Layout(micro_batch_size=b, seq_len=s, precision=m["precision"])
    p = layout.compute_bytes
    dense_layer = ModelShape(**{**m["shape"], "n_layers": 1, "sliding_window": 0})  # the timed kernel's

    def attention_model_flops(seq: int, tokens: float) -> float:  # the family's formula (models/*/spec.py)
        return spec_of(dense_layer).attention_flops_per_token(dense_layer, seq) * tokens

    attention_flops = attention_model_flops(s, b * s) / times["attention"]

    def products(tokens: float, kind: str) -> float:  # the compute term's seconds for one call
        if kind == "loss":  # the head's product
            return 3 * matmul_seconds(tokens, shape.dim, shape.vocab_size, rate, bandwidth, p, 1.0)
        seq = 1 if tokens == 1 else s
        return (sum(3 * c * matmul_seconds(mm, k, n, rate, bandwidth, p, 1.0)
                    for mm, k, n, c in layer_matmuls(shape, tokens, 1))
                + attention_model_flops(seq, tokens) / attention_flops)

    # the planner's own bytes of each kind for the one timed layer (`planning.compute.elementwise_parts`)
    one_layer = ModelShape(**{**m["shape"], "n_layers": 1})
    parts = elementwise_parts(one_layer, layout, estimate_memory(one_layer, layout))
    kernels = {}
    for kind in ("layer", "loss"):
        latency = max(0.0, times[f"{kind}_one_token"] - products(1, kind))
        rest = times[kind] - products(b * s, kind) - latency
        kernels[kind] = {"bandwidth": parts[kind][0] / rest if rest > 0 else bandwidth, "latency": latency}
    kernels["optimizer"] = {"bandwidth": parts["optimizer"][0] / times["optimizer"], "latency": 0.0}
    return {"kernels": kernels, "attention_flops": attention_flops}


def accelerator_of_profile(profile: dict, memory_gib: float) -> Accelerator:
    """A custom accelerator whose peak is the profile's measured matmul rate (the compute model then
    runs at efficiency 1 for large products: the rate is already what they reach), its memory
    bandwidth the measured elementwise rate. A profile that records the CPU cores its ranks shared
    (`cores`) gives the rates one rank reached alone and the cores: the planner then divides them
    by the layout's own sharing (`Accelerator.core_share`), and collectives hide behind nothing."""
    rate, bandwidth = planner_rates(profile)
    cores = int(profile.get("cores") or 0)
    if "kernel_measurements" in profile:  # fitted again, so that the fit follows the planner's byte count of today
        profile = {**profile, **fit_kernels(profile)}
    kernels = {kind: (v["bandwidth"], v["latency"]) for kind, v in profile.get("kernels", {}).items()
               if kind in KERNEL_KINDS}
    net = network_of_profile(profile)
    flops = {key: rate for key in ("bf16", "fp16", "fp32", "tf32")}
    return Accelerator(f"measured {profile.get('device', 'device')}", flops, memory_gib * GiB, net.intra.bandwidth,
                       net.inter.bandwidth, profile.get("gpus_per_node", 8),
                       f"measured by ultratron bench comm ({profile.get('backend')}, {profile.get('world_size')} "
                       f"ranks)", intra_node_latency=net.intra.latency, inter_node_latency=net.inter.latency,
                       memory_bw=bandwidth, memory_achieved=1.0, attention_table=False, cores=cores,
                       threads_per_rank=int(profile.get("threads_per_rank") or 1), comm_uses_cores=bool(cores),
                       kernels=kernels, attention_flops=profile.get("attention_flops", 0.0))
