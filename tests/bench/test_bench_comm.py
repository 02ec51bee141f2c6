"""`ultratron bench comm` measures collectives on real gloo processes and writes a profile that the
planner reads back (`planning/profile.py`): the round trip, and the fit against a hand computation."""

import dataclasses
import json
import os

import pytest

from ultratron.cli import main
from ultratron.errors import UserError
from ultratron.models.presets import PRESETS
from ultratron.planning.comm import BUS_FACTORS, OPS
from ultratron.planning.compute import matmul_seconds
from ultratron.planning.profile import (
    accelerator_of_profile,
    fit_kernels,
    fit_link,
    fit_profile,
    load_profile,
    network_of_profile,
)


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
                 "--matmul-size", "128", "--model", "tiny", "--seq", "16", "--micro-batch", "1"]) == 0
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
    # the tiny model's own work, timed on one rank, and the planner's rates fitted to it, kept as written
    measured = profile["kernel_measurements"]
    assert (measured["model"], measured["micro_batch"], measured["seq"]) == ("tiny", 1, 16)
    assert set(measured["seconds"]) == {"layer", "layer_one_token", "loss", "loss_one_token", "attention", "optimizer"}
    assert all(t > 0 for t in measured["seconds"].values())
    fitted = fit_kernels(profile)
    assert profile["kernels"] == fitted["kernels"] and set(fitted["kernels"]) == {"layer", "loss", "optimizer"}
    assert acc.attention_flops == profile["attention_flops"] == pytest.approx(fitted["attention_flops"])
    assert acc.kernels == {kind: (k["bandwidth"], k["latency"]) for kind, k in profile["kernels"].items()}
    assert main(["plan", "estimate", "--model", "tiny", "--dp", "2", "--seq", "256", "--gpu", "profile",
                 "--profile", str(out)]) == 0
    assert "loss: bytes at the rates bench comm measured" in capsys.readouterr().out
    # an older profile, without them, still loads: that work at the memory bandwidth, attention at the matmul rate
    old = {k: v for k, v in profile.items() if k not in ("kernel_measurements", "kernels", "attention_flops")}
    old_acc = accelerator_of_profile(old, 64.0)
    assert old_acc.kernels == {} and old_acc.attention_flops == 0.0 and old_acc.flops == acc.flops


def test_a_file_that_is_not_a_profile_is_refused(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(UserError, match="not an `ultratron bench comm` profile"):
        load_profile(bad)


def test_fit_kernels_recovers_rates_and_latencies_by_hand():
    # times made from chosen rates by the planner's formula: the compute term's products (at the
    # matmul rate, efficiency 1) and attention (at its rate), then calls × latency + bytes / bandwidth
    shape, b, s, rate, hbm = PRESETS["tiny"], 2, 64, 50e9, 10e9
    tokens = b * s

    def products(m: int, seq: int) -> float:  # one tiny layer: q, k, v, output, gate, up, down; attention 12·s·h
        mm = [(m, 256, 256), (m, 256, 128), (m, 256, 128), (m, 256, 256), (m, 256, 768), (m, 256, 768),
              (m, 768, 256)]
        return sum(3 * matmul_seconds(*p, rate, hbm, 4, 1.0) for p in mm) + 12 * 256 * seq * m / 20e9

    head = lambda m: 3 * matmul_seconds(m, 256, 4096, rate, hbm, 4, 1.0)  # noqa: E731
    # fp32, per token (planning.compute.layer_elementwise_bytes): norms, residuals, rotary, SwiGLU, input-gradient sums
    layer_bytes = tokens * (2 * 256 * (28 + 92) + 2 * 12 * 256 * 2 + 384 * (8 + 10) + 4 * 768 * (5 + 9) + 36 * 256)
    loss_bytes = tokens * 6 * 4 * 4096
    # the one-layer model's states (fp32 weights, gradients, two moments: 16 bytes a parameter), read and
    # written but the gradients: 28 bytes a parameter
    params = 4096 * 256 + 256 * 512 + 256 * 256 + 3 * 256 * 768 + 3 * 256
    seconds = {"attention": 12 * 256 * s * tokens / 20e9, "layer": products(tokens, s) + 1e-3 + layer_bytes / 3e9,
               "layer_one_token": products(1, 1) + 1e-3, "loss": head(tokens) + 5e-4 + loss_bytes / 1e9,
               "loss_one_token": head(1) + 5e-4, "optimizer": 28 * params / 5e9}
    profile = {"matmul_flops": 1.0, "matmul_flops_alone": rate, "memory_bw_alone": hbm, "cores": 2,
               "kernel_measurements": {"model": "tiny", "shape": dataclasses.asdict(shape), "micro_batch": b,
                                       "seq": s, "precision": "fp32", "seconds": seconds}}
    fitted = fit_kernels(profile)
    assert fitted["attention_flops"] == pytest.approx(20e9)
    assert fitted["kernels"]["layer"] == pytest.approx({"bandwidth": 3e9, "latency": 1e-3})
    assert fitted["kernels"]["loss"] == pytest.approx({"bandwidth": 1e9, "latency": 5e-4})
    assert fitted["kernels"]["optimizer"] == pytest.approx({"bandwidth": 5e9, "latency": 0.0})
    # a block no slower than its products (noise): its work left at the memory bandwidth
    seconds["layer"] = products(tokens, s)
    assert fit_kernels(profile)["kernels"]["layer"]["bandwidth"] == hbm


@pytest.mark.parametrize("flags, message", [(["--model", "nosuch"], "--model 'nosuch' is not a preset"),
                                            (["--seq", "512"], "--seq 512 is longer than tiny's max_seq_len 256"),
                                            (["--micro-batch", "0"], "--micro-batch must be positive")])
def test_bench_comm_refuses_a_model_it_cannot_time(flags, message, tmp_path, capsys):
    assert main(["bench", "comm", "--out", str(tmp_path / "p.json"), *flags]) != 0  # before any process starts
    assert message in capsys.readouterr().err and not (tmp_path / "p.json").exists()
