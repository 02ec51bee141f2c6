"""The planner's torch-free restatement of each pipeline schedule (planning/pipeline.py) against
the order PyTorch's own schedules generate, and the stage split and placement rules."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from ultratron.models.presets import PRESETS
from ultratron.planning.pipeline import (
    balanced_split,
    bubble_fraction,
    peak_in_flight,
    rank_stages,
    schedule_events,
    stage_costs,
    stage_layers,
    stage_ranks,
    stage_split,
)

TORCH = {"interleaved-1f1b": torch_schedules.ScheduleInterleaved1F1B,
         "zb": torch_schedules.ScheduleInterleavedZeroBubble,
         "zbv": torch_schedules.ScheduleZBVZeroBubble,
         "dualpipev": torch_schedules.ScheduleDualPipeV}


def torch_events(schedule: str, pp: int, v: int, m: int, rank: int) -> list[tuple[int, int]]:
    """torch's action list for one rank (its schedule-generation method on a bare instance, which
    needs no process group), as (local stage, +1 forward | −1 activations released)."""
    cls = TORCH[schedule]
    sched = object.__new__(cls)
    rounds = max(1, m // pp)
    sched.__dict__.update(pp_group_size=pp, n_local_stages=v, _n_microbatches=m, num_stages=pp * v,
                          number_of_rounds=rounds, microbatches_per_round=m // rounds, rank=rank)
    actions = sched._calculate_single_rank_operations(rank)
    flat = []
    for action in actions:
        if action is None:
            continue
        flat += list(action.sub_actions) if action.sub_actions else [action]
    local = rank_stages(schedule, pp, v, rank)
    kinds = torch_schedules._ComputationType
    out = []
    for action in flat:
        index = local.index(action.stage_index)
        if action.computation_type == kinds.FORWARD:
            out.append((index, +1))
        elif action.computation_type in (kinds.FULL_BACKWARD, kinds.BACKWARD_WEIGHT):
            out.append((index, -1))
    return out


CASES = [("interleaved-1f1b", 2, 2, 4), ("interleaved-1f1b", 4, 2, 8), ("interleaved-1f1b", 4, 3, 6),
         ("interleaved-1f1b", 2, 2, 6), ("zb", 2, 2, 4), ("zb", 4, 2, 8), ("zb", 3, 3, 6),
         ("zbv", 2, 2, 4), ("zbv", 4, 2, 8), ("zbv", 4, 2, 5), ("dualpipev", 2, 2, 4),
         ("dualpipev", 4, 2, 8), ("dualpipev", 3, 2, 10)]


@pytest.mark.parametrize("schedule,pp,v,m", CASES)
def test_the_planners_order_is_torchs(schedule, pp, v, m):
    for rank in range(pp):
        assert schedule_events(schedule, pp, v, m, rank) == torch_events(schedule, pp, v, m, rank), rank


def test_every_micro_batch_is_released_once_per_stage():
    for schedule, pp, v, m in CASES + [("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("1f1b", 4, 1, 3)]:
        for rank in range(pp):
            events = schedule_events(schedule, pp, v, m, rank)
            for local in range(len(rank_stages(schedule, pp, v, rank))):
                mine = [d for j, d in events if j == local]
                assert mine.count(+1) == mine.count(-1) == m
                assert all(sum(mine[:i + 1]) >= 0 for i in range(len(mine)))


def test_in_flight_micro_batches_by_schedule():
    assert peak_in_flight("gpipe", 4, 1, 16, 0, [1.0]) == [16]
    assert [peak_in_flight("1f1b", 4, 1, 16, r, [1.0]) for r in range(4)] == [[4], [3], [2], [1]]
    assert peak_in_flight("1f1b", 4, 1, 2, 0, [1.0]) == [2]
    # interleaved: the first rank's warm-up runs (v−1)·pp + 2·(pp−1) chunk forwards before its first backward
    assert sum(peak_in_flight("interleaved-1f1b", 4, 2, 8, 0, [1.0, 1.0])) == 4 + 6 + 1
    # the V schedules hold about 2·pp chunks (pp micro-batches of the rank's layers) on every rank
    assert [sum(peak_in_flight("zbv", 4, 2, 8, r, [1.0, 1.0])) for r in range(4)] == [8, 8, 8, 8]
    assert peak_in_flight("anything", 1, 1, 8, 0, [1.0]) == [1]


def test_placement_loops_or_folds_into_a_v():
    assert stage_ranks("1f1b", 4) == [0, 1, 2, 3]
    assert stage_ranks("interleaved-1f1b", 2, 3) == [0, 1, 0, 1, 0, 1]
    assert stage_ranks("zbv", 3) == [0, 1, 2, 2, 1, 0]
    assert rank_stages("dualpipev", 3, 0, 0) == [0, 5]
    assert rank_stages("zb", 2, 0, 1) == [1, 3]


def test_balanced_split_counts_the_embedding_and_the_head():
    assert balanced_split(8, 2, 1.0, 0.0, 0.0) == (4, 4)
    assert balanced_split(7, 2, 1.0, 0.0, 0.0) in ((4, 3), (3, 4))
    assert balanced_split(8, 2, 1.0, 0.0, 2.0) == (5, 3)  # a head worth two layers
    assert balanced_split(8, 4, 1.0, 1.0, 1.0) == (2, 2, 2, 2)
    assert balanced_split(10, 4, 1.0, 1.0, 1.0) == (2, 3, 3, 2)
    split = balanced_split(32, 4, 1.0, 0.0, 2.2)
    assert sum(split) == 32 and min(split) >= 1 and max(n + e for n, e in zip(split, (0, 0, 0, 2.2), strict=True)) <= 9
    llama = PRESETS["llama3-8b"]
    embedding, layer, head = stage_costs(llama, "flops", 8192)
    assert embedding == 0 and head == 6 * llama.vocab_size * llama.dim
    by_flops = stage_split(llama, 4, "1f1b", balance="flops", seq=8192)
    by_params = stage_split(llama, 4, "1f1b", balance="params", seq=8192)
    assert sum(by_flops) == sum(by_params) == 32
    assert by_flops[-1] < by_flops[0] and by_params[0] < 8 and by_params[-1] < 8
    assert stage_split(llama, 2, "1f1b", split="10,22") == [10, 22]
    assert [list(r) for r in stage_layers([2, 1, 3])] == [[0, 1], [2], [3, 4, 5]]


def test_bubble_estimates():
    assert bubble_fraction("1f1b", 4, 1, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("gpipe", 4, 1, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("interleaved-1f1b", 4, 2, 8) == pytest.approx(3 / 16)
    assert bubble_fraction("zb", 4, 2, 8) == pytest.approx(3 / 48)
    assert bubble_fraction("zbv", 4, 0, 8) == pytest.approx(3 / 24)
    assert bubble_fraction("1f1b", 1, 1, 8) == 0.0
