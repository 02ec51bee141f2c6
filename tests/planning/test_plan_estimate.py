"""`ultratron plan estimate`: one explicit layout → peak memory, step time, tokens/s/GPU, MFU and the
terms behind them; `plan search` ranks layouts with the same function (`search.estimate_step`)."""

import json
import re

import pytest

from ultratron.cli import main
from ultratron.models.presets import PRESETS
from ultratron.planning.compute import compute_efficiency
from ultratron.planning.flops import flops_per_token_of
from ultratron.planning.layout import Layout
from ultratron.planning.memory import MemoryBreakdown
from ultratron.planning.params import count_params_of

H100_BF16 = 989.4e12


def plan(capsys, *argv):
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def estimate_json(capsys, *flags) -> dict:
    code, out, err = plan(capsys, "estimate", "--model", "llama3-8b", *flags, "--json")
    assert code == 0, err
    return json.loads(out)


def test_estimate_json_has_the_numbers_and_their_terms(capsys):
    data = estimate_json(capsys, "--dp", "8", "--zero", "2", "--seq", "8192", "--grad-acc", "16",
                         "--recompute", "selective", "--gpu", "h100-sxm", "--gpus-per-node", "8")
    assert data["n_gpus"] == 8 and data["batch_tokens"] == 8 * 16 * 8192 and data["gpu"] == "H100 SXM"
    memory, time = data["memory"], data["time"]
    # ZeRO-2: backward's peak holds every term but FSDP2's sharded gradients, made after it
    backward = sum(memory[t] for t in MemoryBreakdown.TERMS) - memory["gradients"]
    assert memory["backward_gradients"] == 0 and memory["backward_bytes"] == pytest.approx(backward)
    assert data["peak_bytes"] == pytest.approx(max(backward, memory["step_bytes"]))
    assert data["step_seconds"] == pytest.approx(sum(time[t] for t in (
        "compute_s", "elementwise_s", "tp_comm_s", "cp_exposed_s", "pp_comm_s", "bubble_s", "dp_exposed_s",
        "optimizer_s")))
    assert data["tokens_per_sec_per_gpu"] == pytest.approx(data["batch_tokens"] / data["step_seconds"] / 8)
    shape = PRESETS["llama3-8b"]
    flops = flops_per_token_of(shape, 8192)
    assert data["mfu"] == pytest.approx(data["tokens_per_sec_per_gpu"] * flops / H100_BF16)
    # compute by hand: global tokens × FLOPs/token × 1.02 (selective recompute) over 8 GPUs at the peak
    # times the efficiency of this layout's matmul and attention shapes (planning.compute)
    efficiency = compute_efficiency(shape, Layout(dp=8, zero=2, seq_len=8192, grad_accum=16, recompute="selective"),
                                    H100_BF16, 0.92 * 3.35e12)  # the bandwidth kernels reach
    assert data["compute_efficiency"] == pytest.approx(efficiency)
    assert time["compute_s"] == pytest.approx(data["batch_tokens"] * flops * 1.02 / (8 * H100_BF16 * efficiency))
    assert data["fits"] is (data["peak_bytes"] <= data["usable_bytes"])
    assert memory["extra"]["data_parallel"] == "fsdp"


def test_search_ranks_with_the_function_estimate_prints(capsys, tmp_path):
    code, out, _ = plan(capsys, "search", "--model", "llama3-8b", "--gpus", "8", "--batch-tokens", "1048576",
                        "--seq", "8192", "--top", "3", "--out", "-", "--json")
    assert code == 0
    for ranked in json.loads(out)["layouts"]:
        lay = ranked["layout"]
        # every layout field is a flag of the same name (a bool: --name / --no-name)
        flags = [(f"--{k}" if v else f"--no-{k}") if isinstance(v, bool) else f"--{k}={v}"
                 for k, v in ((k.replace("_", "-"), v) for k, v in lay.items()) if v is not None]
        alone = estimate_json(capsys, *flags)
        for key in ("peak_bytes", "step_seconds", "tokens_per_sec_per_gpu", "mfu", "time"):
            assert alone[key] == ranked[key], (ranked["describe"], key)


def test_estimate_refuses_sweeps_and_bad_layouts(capsys):
    code, _, err = plan(capsys, "estimate", "--model", "llama3-8b", "--tp", "1,2")
    assert code == 2 and "plan estimate takes one layout" in err
    code, _, err = plan(capsys, "estimate", "--model", "llama3-8b", "--tp", "3", "--efficiency", "2")
    assert code == 2 and "tp=3 does not divide n_heads=32" in err and "--efficiency must lie in (0, 1]" in err
    code, out, _ = plan(capsys, "estimate", "--model", "llama3-70b", "--seq", "8192")
    assert code == 0 and "does NOT fit" in out  # a 70B model on one GPU: an estimate, and the verdict


def test_estimate_prints_the_step_as_a_table_whose_parts_add_up(capsys):
    code, out, _ = plan(capsys, "estimate", "--model", "llama3-70b", "--dp", "8", "--tp", "8", "--sp", "--pp", "4",
                        "--zero", "1", "--seq", "8192", "--grad-acc", "16")
    assert code == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("term"))
    rows = {line.split("  ")[0].strip(): line for line in lines[header + 2:] if line and not line.startswith("   -")}
    assert {"compute", "tp all-gather", "tp reduce-scatter", "pp p2p", "dp all-gather", "pipeline bubble",
            "step"} <= set(rows)
    assert "(nodes)" in rows["pp p2p"] and "(nodes)" not in rows["tp all-gather"]  # stages 64 ranks apart
    # FSDP's gathers: their time, and the part the compute does not hide (the first block's of each micro-batch)
    ms = lambda text: float(text.split()[0]) * (1e-3 if text.endswith("ms") else 1)  # noqa: E731
    total, shown = re.search(r"([\d.]+ m?s), hidden by compute +([\d.]+ m?s)", rows["dp all-gather"]).groups()
    assert 0 < ms(shown) < ms(total)
    shares = [float(line.split()[-1].rstrip("%")) for name, line in rows.items() if name != "step"]
    assert sum(shares) == pytest.approx(100, abs=0.1 * len(shares))  # each share rounded to 0.1 %


def test_custom_gpu_and_figure_overrides(capsys):
    base = ("--model", "llama3-8b", "--dp", "16", "--zero", "3", "--seq", "4096", "--json")
    code, _, err = plan(capsys, "estimate", *base, "--gpu", "custom", "--peak-tflops", "500")
    assert code == 2 and "--gpu custom needs --memory-gib, --nvlink-gbs, --network-gbs" in err
    custom = estimate_json(capsys, *base, "--gpu", "custom", "--peak-tflops", "500", "--memory-gib", "80",
                           "--nvlink-gbs", "450", "--network-gbs", "50", "--gpus-per-node", "8")
    h100 = estimate_json(capsys, *base, "--gpu", "h100-sxm", "--peak-tflops", "500")
    assert custom["gpu"] == "custom" and custom["time"]["compute_s"] == pytest.approx(h100["time"]["compute_s"])
    slow = estimate_json(capsys, *base, "--gpu", "h100-sxm", "--network-gbs", "5")  # dp=16 spans two nodes
    fast = estimate_json(capsys, *base, "--gpu", "h100-sxm")
    assert slow["time"]["dp_comm_s"] > 5 * fast["time"]["dp_comm_s"]


def test_search_prices_collectives_with_a_profile(capsys, tmp_path):
    # a profile as `bench comm` writes it (planning/profile.py): per-operation links inside a node
    links = {op: {"bandwidth": 1e9 * (i + 1), "latency": 1e-4 * (i + 1)}
             for i, op in enumerate(("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "broadcast", "p2p"))}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": "ultratron-comm-profile", "version": 1, "device": "cpu", "backend": "gloo",
                                "world_size": 4, "gpus_per_node": 4, "matmul_flops": 5e10, "intra": links,
                                "inter": {}}))
    code, out, _ = plan(capsys, "search", "--model", "tiny", "--gpus", "4", "--batch-tokens", "8192", "--seq", "256",
                        "--precision", "fp32", "--gpu", "profile", "--profile", str(path), "--out", "-", "--json",
                        "--top", "20")
    assert code == 0
    priced = [c for est in json.loads(out)["layouts"] for c in est["collectives"]]
    assert priced
    for c in priced:  # every collective at its operation's measured link (one node: no network)
        link = links[c["op"]]
        factor = {"all-reduce": 2 * (c["group"] - 1) / c["group"], "broadcast": 1, "p2p": 1}.get(
            c["op"], (c["group"] - 1) / c["group"])
        assert not c["spans_nodes"]
        assert c["seconds"] == pytest.approx(c["calls"] * (c["nbytes"] * factor / link["bandwidth"] + link["latency"]))


def test_fp8_gathers_one_byte_weights_and_runs_the_blocks_matmuls_at_the_fp8_peak(capsys):
    layout = ["--dp", "8", "--zero", "2", "--seq", "8192", "--gpu", "h100-sxm", "--gpus-per-node", "8"]
    bf16, fp8 = (estimate_json(capsys, *layout, "--precision", p) for p in ("bf16", "fp8"))
    shape = PRESETS["llama3-8b"]
    # ZeRO-2 holds every weight gathered: 2 bytes each in bf16, the fp8 copy (1 byte) under fp8
    gathered = bf16["memory"]["parameters"] - fp8["memory"]["parameters"]
    assert gathered == pytest.approx(count_params_of(shape).total * (2 - 1), rel=1e-9)
    # rowwise scales need the whole weight: FSDP2 gathers bf16, as under bf16, and its gathers cost as much
    rowwise = estimate_json(capsys, *layout, "--precision", "fp8", "--fp8-scaling", "rowwise")
    assert rowwise["memory"]["parameters"] == pytest.approx(bf16["memory"]["parameters"])
    gathers = {name: [(c["nbytes"], c["calls"]) for c in run["collectives"] if c["op"] == "all-gather"]
               for name, run in (("bf16", bf16), ("fp8", fp8), ("rowwise", rowwise))}
    assert gathers["rowwise"] == gathers["bf16"] and gathers["bf16"]
    assert gathers["fp8"] == [(nbytes / 2, calls) for nbytes, calls in gathers["bf16"]]
    # MFU is against the fp8 peak (H100 SXM datasheet: 1,978.9 dense); the blocks' matmuls run at it,
    # the head and attention at the bf16 one. By hand, per token: blocks 6 × 7.0e9 FLOPs at twice the
    # rate, head 6 × 0.53e9 and attention 12·L·h·s = 12.9e9 at bf16's: (21 + 3.2 + 12.9) / 58 = 0.64 of
    # bf16's time (0.61 as modelled, attention's efficiency differing); all at fp8 would be 0.5
    assert fp8["mfu"] == pytest.approx(fp8["tokens_per_sec_per_gpu"] * flops_per_token_of(shape, 8192) / 1978.9e12)
    ratio = fp8["time"]["compute_s"] / bf16["time"]["compute_s"]
    assert 0.55 < ratio < 0.7, ratio
    efficiency = compute_efficiency(shape, Layout(dp=8, zero=2, seq_len=8192, precision="fp8"), 1978.9e12,
                                    0.92 * 3.35e12, bf16_peak=H100_BF16)
    assert fp8["compute_efficiency"] == pytest.approx(efficiency)
    code, _, err = plan(capsys, "estimate", "--model", "llama3-8b", "--gpu", "a100-80gb", "--precision", "fp8")
    assert code != 0 and "no fp8 peak for A100 80GB" in err


def test_estimate_prices_compile_and_flags_fp8_as_an_upper_bound(capsys):
    """`--compile` prices the fused kernels: less elementwise time, the matmuls the same; under fp8
    the table is followed by the note that its matmul rate is not measured."""
    flags = ("--dp", "8", "--zero", "3", "--seq", "8192", "--mbs", "2", "--gpu", "h100-sxm")
    eager, compiled = estimate_json(capsys, *flags), estimate_json(capsys, *flags, "--compile")
    assert compiled["time"]["compute_s"] == pytest.approx(eager["time"]["compute_s"])
    assert compiled["time"]["elementwise_s"] < 0.5 * eager["time"]["elementwise_s"]
    code, out, _ = plan(capsys, "estimate", "--model", "llama3-8b", *flags, "--precision", "fp8")
    assert code == 0 and "fp8: the blocks' matmuls are priced at the fp8 peak" in out
    code, out, _ = plan(capsys, "estimate", "--model", "llama3-8b", *flags)
    assert code == 0 and "fp8" not in out


def test_the_step_table_writes_bytes_in_si_units(capsys):
    """A collective's size per call: 1.00GB, not the parameter counts' 1.00B with a unit after it."""
    from ultratron.cli.plan_output import human

    assert human(8.03e9) == "8.03B" and human(1.0e9, "B") == "1.00GB" and human(2.5e6, "B") == "2.50MB"
    code, out, _ = plan(capsys, "estimate", "--model", "llama3-8b", "--dp", "8", "--zero", "3", "--seq", "8192",
                        "--mbs", "2", "--gpu", "h100-sxm")
    assert code == 0 and "1.00GB" in out and "BB" not in out  # the fp32 gradients' reduce-scatter per block


def test_search_with_compile_proposes_only_what_the_trainer_compiles(capsys, tmp_path):
    """The trainer does not yet compile blocks under tensor parallel: `plan search --compile` keeps to
    tp = 1, and the config it writes loads; `plan estimate` prices compile with tp (torchtitan runs
    it) and says the trainer cannot run it yet."""
    from ultratron.config import load_config

    out = tmp_path / "best.toml"
    code, text, _ = plan(capsys, "search", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--compile",
                         "--seq", "8192", "--batch-tokens", str(2**20), "--top", "3", "--out", str(out))
    assert code == 0 and "tp=1 " in text and "tp=2" not in text and "tp=4" not in text and "tp=8" not in text
    cfg = load_config(out)
    assert cfg.training.compile and cfg.parallel.tp == 1
    code, text, _ = plan(capsys, "estimate", "--model", "llama3-8b", "--tp", "8", "--compile", "--gpu", "h100-sxm")
    assert code == 0 and "priced, but not yet for ultratron's trainer: compile does not yet work with tp=8" in text


def test_gpus_is_checked_against_the_layout_and_not_read_as_gpus_per_node(capsys):
    # argparse's prefix matching once read `--gpus 64` as `--gpus-per-node 64`: 64 GPUs on one node
    code, _, err = plan(capsys, "estimate", "--model", "llama3-8b", "--gpus", "64", "--tp", "8", "--seq", "8192")
    assert code == 2 and "--gpus 64, but the layout (dp 1 × tp 8 × pp 1 × cp 1) uses 8" in err
    data = estimate_json(capsys, "--gpus", "64", "--dp", "8", "--tp", "8", "--seq", "8192")
    assert data["n_gpus"] == 64 and data["gpus_per_node"] == 8


def test_a_reader_that_leaves_early_gets_no_traceback():
    import os
    import subprocess
    import sys

    # a pipe whose reading end is closed before the command starts: every write it makes fails
    read, write = os.pipe()
    os.close(read)
    script = "import sys; from ultratron.cli import main; sys.exit(main())"
    try:
        run = subprocess.run([sys.executable, "-c", script, "plan", "estimate", "--model", "llama3-8b", "--dp", "8",
                              "--seq", "8192"], stdout=write, stderr=subprocess.PIPE, text=True, check=False)
    finally:
        os.close(write)
    assert run.returncode == 141 and "Traceback" not in run.stderr, run.stderr
