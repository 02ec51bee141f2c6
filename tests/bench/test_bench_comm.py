"""`ultratron bench comm` measures collectives on real gloo processes and writes a profile that the
planner reads back (`planning/profile.py`): the round trip, and the fit against a hand computation."""

import json
import os

import pytest

from ultratron.cli import main
from ultratron.errors import UserError
from ultratron.planning.comm import BUS_FACTORS, OPS
from ultratron.planning.profile import accelerator_of_profile, fit_link, fit_profile, load_profile, network_of_profile


def test_fit_recovers_latency_and_bus_bandwidth_by_hand():
    # synthetic all-reduce on 4 ranks: 50 µs + bytes × 2·3/4 / 2 GB/s
    points = [(b, 50e-6 + b * 1.5 / 2e9) for b in (4096, 65536, 2**20, 2**24)]
    link = fit_link("all-reduce", 4, sorted(points)[::-1])
    # the latency is the smallest message's time; the bandwidth the median over the larger half of
    # bytes × factor / (time − latency), which counts the smallest message's bytes once too often
    assert link.latency == pytest.approx(50e-6 + 4096 * 1.5 / 2e9)
    assert link.bandwidth == pytest.approx((2e9 * 2**20 / (2**20 - 4096) + 2e9 * 2**24 / (2**24 - 4096)) / 2)
    rows = [{"op": "p2p", "group": 2, "spans_nodes": True, "bytes": b, "seconds": 1e-4 + b / 1e9} for b in (1e3, 1e7)]
    fitted = fit_profile(rows)
    assert fitted["intra"] == {} and fitted["inter"]["p2p"]["bandwidth"] == pytest.approx(1e9, rel=1e-3)


def test_bench_comm_profile_round_trips_into_the_planner(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["bench", "comm", "--nproc", "2", "--out", str(out), "--max-bytes", "65536", "--repeat", "2",
                 "--matmul-size", "128"]) == 0
    printed = capsys.readouterr().out
    assert "intra-node all-reduce" in printed and f"--profile {out}" in printed
    profile = load_profile(out)
    assert profile["world_size"] == 2 and profile["backend"] == "gloo" and profile["matmul_flops"] > 0
    # the rates every rank reached at once and one rank alone, and the cores the ranks shared
    assert profile["matmul_flops_alone"] > 0 and profile["memory_bw"] > 0 and profile["memory_bw_alone"] > 0
    assert profile["cores"] == len(os.sched_getaffinity(0)) and profile["threads_per_rank"] >= 1
    assert set(profile["intra"]) == set(OPS) and profile["inter"] == {}  # one machine: no cross-node links
    sizes = sorted({m["bytes"] for m in profile["measurements"]})
    assert sizes == [4096, 16384, 65536]
    # what the planner prices is what the fit of the raw measurements says, op by op
    net = network_of_profile(profile)
    for op in OPS:
        link = fit_link(op, 2, [(m["bytes"], m["seconds"]) for m in profile["measurements"] if m["op"] == op])
        assert net.seconds(op, 65536, 2, 1) == pytest.approx(65536 * BUS_FACTORS[op](2) / link.bandwidth
                                                             + link.latency)
    # and plan estimate reads it: links from the profile, peak from its matmul rate
    code = main(["plan", "estimate", "--model", "tiny", "--dp", "2", "--seq", "256", "--gpu", "profile",
                 "--profile", str(out), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["profile"] == str(out) and data["gpu"] == "measured cpu"
    acc = accelerator_of_profile(profile, 64.0)  # a CPU: its alone rates, divided by the ranks' share of cores
    assert acc.flops["fp32"] == profile["matmul_flops_alone"] and acc.memory_bw == profile["memory_bw_alone"]
    assert acc.cores == profile["cores"] and acc.comm_uses_cores
    assert data["core_share"] == pytest.approx(max(1.0, 2 * profile["threads_per_rank"] / profile["cores"]))
    reduce = [c for c in data["collectives"] if c["axis"] == "dp"][0]
    assert reduce["seconds"] == pytest.approx(reduce["calls"] * net.seconds(reduce["op"], reduce["nbytes"], 2, 1))


def test_a_file_that_is_not_a_profile_is_refused(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(UserError, match="not an `ultratron bench comm` profile"):
        load_profile(bad)
