"""Pipeline parallelism without torch: the schedules, which rank runs which stage, how the layers
are cut into stages, and how many micro-batches' activations a rank holds at its peak. The trainer
(`ultratron.parallel.pipeline`) and the planner (`plan memory`, `plan search`) call these same
functions, so the split and the schedule the planner prices are the ones the trainer runs. The
rules a pipeline layout must obey are in `planning/rules.py`.

The schedules are PyTorch's (`torch.distributed.pipelining`):

  gpipe             every forward, then every backward (GPipe, Huang et al. 2019); 1 stage per rank
  1f1b              one forward, one backward in the steady state (PipeDream-Flush, Narayanan et al.
                    2021); the first stage holds pp micro-batches in flight instead of all m
  interleaved-1f1b  1F1B over v stages per rank, stage s on rank s mod pp (Narayanan et al. 2021):
                    the bubble shrinks v-fold for v-fold more point-to-point traffic
  zb                interleaved, with the backward split into an input part (I) and a weight part (W);
                    the W's fill the bubble (zero bubble ZB-1P, Qi et al. 2023, arXiv 2401.10241)
  zbv               zero bubble on a V: rank r holds stages r and 2·pp−1−r (Qi et al. 2023 §6)
  dualpipev         DeepSeek-V3's DualPipe folded into a V (DeepSeek-AI 2024, arXiv 2412.19437): a
                    forward of one micro-batch is paired with a backward of another

The stage split balances a cost per stage over contiguous runs of layers: FLOPs per token of
training (6 per matmul weight + 12·h·s for attention per layer, as in `planning/flops.py`; the
embedding is a lookup and costs none; the head costs 6·v·h, the cross-entropy's O(v) is left
out) or parameters (the embedding v·h on the first stage; the final norm and a head of v·h on the
last, its own copy when the embeddings are tied). `parallel.pp_split` overrides it.
"""

from __future__ import annotations

import functools
import math

from ultratron.models.specs import spec_of
from ultratron.planning.params import count_params_of

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb", "zbv", "dualpipev")
SINGLE = ("gpipe", "1f1b")  # one stage per rank
LOOPED = ("interleaved-1f1b", "zb")  # v stages per rank, stage s on rank s mod pp
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank: rank r holds stages r and 2·pp−1−r
SPLIT_BACKWARD = ("zb", "zbv", "dualpipev")  # the backward runs as an input part and a weight part
BALANCES = ("flops", "params")


def stages_per_rank(schedule: str, virtual_stages: int = 0) -> int:
    """Stages each rank runs: 1 for gpipe and 1f1b, 2 for the V schedules, `virtual_stages` (0: 2)
    for the looped ones."""
    if schedule in V_SHAPED:
        return 2
    if schedule in LOOPED:
        return virtual_stages or 2
    return 1


def stage_ranks(schedule: str, pp: int, virtual_stages: int = 0) -> list[int]:
    """The pipeline rank that runs each stage, in stage order."""
    n_stages = pp * stages_per_rank(schedule, virtual_stages)
    if schedule in V_SHAPED:
        return [s if s < pp else 2 * pp - 1 - s for s in range(n_stages)]
    return [s % pp for s in range(n_stages)]


def rank_stages(schedule: str, pp: int, virtual_stages: int, rank: int) -> list[int]:
    """The stages one pipeline rank runs, in stage order (its local stages 0, 1, ...)."""
    return [s for s, r in enumerate(stage_ranks(schedule, pp, virtual_stages)) if r == rank]


# ---- the stage split -------------------------------------------------------------------------

def stage_costs(shape, balance: str, seq: int) -> tuple[float, float, float]:
    """(embedding, one layer, head + loss) in the balance's unit (see the module docstring)."""
    counts = count_params_of(shape)
    # (a mixture of experts' dense first layers are counted as the average layer)
    if balance == "params":
        return float(counts.embedding), counts.mean_layer, float(counts.final_norm + counts.embedding)
    attention = spec_of(shape).attention_flops_per_token(shape, seq) / counts.n_layers  # the mean layer's
    layer = 6.0 * counts.active_layers / counts.n_layers + attention
    return 0.0, layer, 6.0 * shape.vocab_size * shape.dim


@functools.lru_cache(maxsize=1024)
def balanced_split(n_layers: int, n_stages: int, layer: float, first: float, last: float) -> tuple[int, ...]:
    """Layers per stage, each ≥ 1, contiguous, minimising the largest stage cost, where a stage costs
    `layer` per layer plus `first` on stage 0 and `last` on the final stage. Among the splits that
    reach that cost, surplus layers are taken from the costliest stages first (on ties the one with
    more layers, then the later one), so the split stays as even as the extra costs allow."""
    if n_stages == 1:
        return (n_layers,)
    extras = [first] + [0.0] * (n_stages - 2) + [last]

    def capacity(limit: float) -> list[int]:
        return [max(0, math.floor((limit - extra) / layer + 1e-9)) for extra in extras]

    candidates = sorted({extra + k * layer for extra in set(extras) for k in range(1, n_layers + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:  # the smallest limit whose capacities hold every layer with ≥ 1 per stage
        mid = (lo + hi) // 2
        caps = capacity(candidates[mid])
        if min(caps) >= 1 and sum(caps) >= n_layers:
            hi = mid
        else:
            lo = mid + 1
    counts = capacity(candidates[lo])
    while sum(counts) > n_layers:
        costs = [(n * layer + extra, n, i) for i, (n, extra) in enumerate(zip(counts, extras, strict=True)) if n > 1]
        *_, worst = max(costs)
        counts[worst] -= 1
    return tuple(counts)


def parse_split(text: str) -> list[int] | None:
    """'3,5' → [3, 5]; None when it is not a comma-separated list of integers."""
    try:
        return [int(part) for part in text.replace(" ", "").split(",")]
    except ValueError:
        return None


def stage_split(shape, pp: int, schedule: str = "1f1b", virtual_stages: int = 0, balance: str = "flops",
                seq: int = 4096, split: str | None = None) -> list[int]:
    """Layers per stage (pp × stages-per-rank entries, in stage order): `split` if given (already
    validated by `planning.rules.pipeline_problems`), else balanced by `balance`."""
    n_stages = pp * stages_per_rank(schedule, virtual_stages) if pp > 1 else 1
    if split:
        return parse_split(split)
    embedding, layer, head = stage_costs(shape, balance, seq)
    return list(balanced_split(shape.n_layers, n_stages, layer, embedding, head))


def stage_layers(split: list[int]) -> list[range]:
    """The layer indices of each stage, from the layers per stage."""
    starts = [sum(split[:i]) for i in range(len(split))]
    return [range(start, start + n) for start, n in zip(starts, split, strict=True)]


# ---- the order of work on one rank, and what it keeps alive ---------------------------------

def _looped_events(pp: int, v: int, m: int, rank: int, zero_bubble: bool) -> list[tuple[int, int]]:
    """ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble's order on one rank, as (local stage,
    +1 forward | −1 activations released). Warm-up: (v−1)·per_round + k·(pp−1−rank) forwards (k = 2,
    or 1 for zero bubble), capped at v·m; then one forward and one backward per step; then the
    remaining backwards. Zero bubble releases a micro-batch at its weight backward, which lags the
    input backward by `rank` steps."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * v)
    ops = v * m

    def forward_local(step: int) -> int:
        return (step // per_round) % v

    def backward_local(step: int) -> int:
        return v - 1 - ((step - warmup) // per_round) % v

    events: list[tuple[int, int]] = []
    pending_w: list[int] = []
    for step in range(ops + warmup):
        if step < ops:
            events.append((forward_local(step), +1))
        if step >= warmup:
            local = backward_local(step)
            if not zero_bubble:
                events.append((local, -1))
            else:
                pending_w.append(local)
                if step - warmup >= rank:
                    events.append((pending_w.pop(0), -1))
    events += [(local, -1) for local in pending_w]
    return events


def _zbv_events(pp: int, m: int, rank: int) -> list[tuple[int, int]]:
    """ScheduleZBVZeroBubble's order (local 0 = stage rank, local 1 = stage 2·pp−1−rank); an input
    backward keeps the graph, its weight backward releases it."""
    n = max(2 * pp - 1, m)
    order: list[tuple[int, str, int]] = []  # (local, F|I|W, micro-batch)
    count = {(c, k): 0 for c in (0, 1) for k in "FIW"}

    def act(chunk: int, kinds: str) -> None:
        for kind in kinds:
            order.append((chunk, kind, count[chunk, kind]))
            count[chunk, kind] += 1

    act(0, "F" * (2 * (pp - rank) - 1))
    for _ in range(rank):
        act(1, "F")
        act(0, "F")
    for _ in range(pp - rank):
        act(1, "FIW")
    while count[1, "F"] < count[0, "F"] or count[0, "F"] < n:
        if count[0, "F"] < n:
            act(0, "F")
        act(0, "IW")
        act(1, "FIW")
    for _ in range(rank):
        act(0, "I")
        act(1, "I")
    for _ in range(pp - rank):
        act(0, "IW")
    act(1, "W" * (count[1, "I"] - count[1, "W"]))
    act(0, "W" * (count[0, "I"] - count[0, "W"]))
    return [(chunk, +1 if kind == "F" else -1) for chunk, kind, mb in order if mb < m and kind != "I"]


def _dualpipev_events(pp: int, m: int, rank: int) -> list[tuple[int, int]]:
    """ScheduleDualPipeV's order (local 0 = stage rank, local 1 = stage 2·pp−1−rank); a paired
    forward+backward is counted forward first. Full backwards release at once, input backwards
    when their queued weight backward runs."""
    events: list[tuple[int, int]] = []
    weights: list[int] = []

    def f(chunk: int) -> None:
        events.append((chunk, +1))

    def b(chunk: int, split: bool = False) -> None:
        if split:
            weights.append(chunk)
        else:
            events.append((chunk, -1))

    def w() -> None:
        if weights:
            events.append((weights.pop(0), -1))

    for _ in range((pp - rank - 1) * 2):
        f(0)
    for _ in range(rank + 1):
        f(0)
        f(1)
    for _ in range(pp - rank - 1):
        b(1, split=True)
        w()
        f(1)
    for _ in range(m - 2 * pp + rank + 1):  # the main phase: F0 with B1, then F1 with B0
        f(0)
        b(1)
        f(1)
        b(0)
    for _ in range(pp - rank - 1):
        b(1)
        f(1)
        b(0)
    zero_bubble = False
    steps = rank + 1
    for i in range(steps):
        zero_bubble = zero_bubble or (i == steps // 2 and rank % 2 == 1)
        b(1, split=zero_bubble)
        zero_bubble = zero_bubble or (i == steps // 2 and rank % 2 == 0)
        b(0, split=zero_bubble)
    for _ in range(pp - rank - 1):
        w()
        b(0, split=zero_bubble)
    while weights:
        w()
    return events


@functools.lru_cache(maxsize=4096)
def schedule_events(schedule: str, pp: int, virtual_stages: int, m: int, rank: int) -> list[tuple[int, int]]:
    """One rank's forwards (+1) and activation releases (−1) per local stage, in the order its
    schedule runs them for `m` micro-batches (cached: treat the list as read-only)."""
    v = stages_per_rank(schedule, virtual_stages)
    if pp == 1 or schedule == "gpipe":
        return [(0, +1)] * m + [(0, -1)] * m
    if schedule == "1f1b":
        warmup = min(m, pp - rank)
        events = [(0, +1)] * warmup
        for _ in range(m - warmup):
            events += [(0, -1), (0, +1)]
        return events + [(0, -1)] * warmup
    if schedule in LOOPED:
        return _looped_events(pp, v, m, rank, zero_bubble=schedule == "zb")
    if schedule == "zbv":
        return _zbv_events(pp, m, rank)
    return _dualpipev_events(pp, m, rank)


@functools.lru_cache(maxsize=4096)
def _peak_candidates(schedule: str, pp: int, virtual_stages: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """The micro-batches in flight per local stage after each forward, without repeats and without
    states another one dominates: whatever the bytes per stage, the peak is one of these."""
    live = [0] * len(rank_stages(schedule, pp, virtual_stages, rank))
    seen: set[tuple[int, ...]] = set()
    for local, delta in schedule_events(schedule, pp, virtual_stages, m, rank):
        live[local] += delta
        if delta > 0:
            seen.add(tuple(live))
    return tuple(a for a in seen if not any(b != a and all(x <= y for x, y in zip(a, b, strict=True)) for b in seen))


def peak_in_flight(schedule: str, pp: int, virtual_stages: int, m: int, rank: int,
                   bytes_per_micro_batch: list[float]) -> list[int]:
    """Micro-batches in flight on each local stage at the moment the rank's activations peak,
    given each local stage's activation bytes for one micro-batch. With pp = 1: [1] (one forward
    and its backward at a time, as gradient accumulation runs)."""
    if pp == 1:
        return [1]
    candidates = _peak_candidates(schedule, pp, virtual_stages, m, rank)
    best = max(candidates, key=lambda live: (sum(n * b for n, b in zip(live, bytes_per_micro_batch, strict=True)),
                                             live))
    return list(best)


def bubble_fraction(schedule: str, pp: int, virtual_stages: int, m: int) -> float:
    """The pipeline's idle time as a fraction of its ideal (bubble-free) compute time, by the
    published estimates: GPipe and 1F1B (p−1)/m, interleaved (p−1)/(v·m) (Narayanan et al. 2021);
    zero bubble with the backward split evenly into input and weight parts (B = 2F, W = F) leaves
    (p−1)(F+B−2W) of (p−1)(F+B), a third (Qi et al. 2023), per stage of the interleaving; DualPipeV
    (p−1)(F&B+B−3W) over chunks of half a rank's layers (DeepSeek-AI 2024) is also a third of
    1F1B's, as is ZBV here. The benchmark `benchmarks/pipeline_bubble.py` measures it."""
    if pp == 1:
        return 0.0
    v = stages_per_rank(schedule, virtual_stages)
    if schedule in SINGLE:
        return (pp - 1) / m
    if schedule == "interleaved-1f1b":
        return (pp - 1) / (v * m)
    if schedule == "zb":
        return (pp - 1) / (3 * v * m)
    return (pp - 1) / (3 * m)
