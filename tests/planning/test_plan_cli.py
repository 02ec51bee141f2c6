import json
import subprocess
import sys
from dataclasses import replace

import pytest

from ultratron.cli import main
from ultratron.config import load_config
from ultratron.models.presets import PRESETS
from ultratron.planning.layout import Layout
from ultratron.planning.memory import estimate_memory_per_rank

LLAMA8B = PRESETS["llama3-8b"]


def run_plan(capsys, *argv):
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_commands_and_planning_import_no_torch(tmp_path):
    script = f"""
import sys, contextlib, io
import ultratron.planning, ultratron.planning.memory, ultratron.planning.scaling
import ultratron.planning.search, ultratron.planning.hardware, ultratron.cli.plan
from ultratron.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    codes = [main(["plan", "memory", "--model", "llama3-8b", "--json", "--chart", r"{tmp_path / 'm.png'}"]),
             main(["plan", "scaling", "--flops", "5.76e23"]),
             main(["plan", "search", "--model", "llama3-8b", "--gpus", "8", "--batch-tokens", "1048576",
                   "--seq", "8192", "--out", r"{tmp_path / 'best.toml'}"])]
print(codes, "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[0, 0, 0] False"
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def test_memory_json_has_peak_bytes_and_the_textbook_numbers(capsys):
    code, out, _ = run_plan(capsys, "memory", "--n-layers", "32", "--dim", "4096", "--n-heads", "32",
                            "--n-kv-heads", "32", "--ffn-dim", "16384", "--vocab-size", "32000",
                            "--no-tie-embeddings", "--seq", "4096", "--recompute", "none,selective",
                            "--activation-model", "textbook", "--json")
    data = json.loads(out)
    assert code == 0 and len(data["layouts"]) == 2
    layer_gib = [lay["extra"]["per_layer_activation_bytes"] * 32 / 2**30 for lay in data["layouts"]]
    assert layer_gib == [pytest.approx(97.0, abs=0.05), pytest.approx(17.0, abs=0.05)]
    assert data["peak_bytes"] == max(lay["peak_bytes"] for lay in data["layouts"])
    # one process, one micro-batch: backward's peak comes before the step's gradients are made
    first = data["layouts"][0]
    assert first["peak_moment"] == "backward" and first["backward_gradients"] == 0
    assert first["peak_bytes"] == pytest.approx(sum(
        first[t] for t in ("parameters", "grad_accum_buffer", "master_weights", "optimizer_states", "activations",
                           "loss_logits", "comm_buffers", "transient")))


def test_memory_table_sweeps_and_charts(capsys, tmp_path):
    chart = tmp_path / "sweep.png"
    code, out, _ = run_plan(capsys, "memory", "--model", "llama3-8b", "--tp", "1,2,4", "--sp", "--seq", "8192",
                            "--chart", str(chart))
    assert code == 0
    assert "#3: dp=1 tp=4+sp" in out
    peaks = [float(x) for x in next(line for line in out.splitlines() if line.startswith("peak")).split()[1:]]
    assert peaks[0] > peaks[1] > peaks[2]
    assert chart.read_bytes()[:4] == b"\x89PNG"


def test_a_pipeline_with_fewer_micro_batches_than_stages_is_estimated_with_a_warning(capsys):
    code, out, err = run_plan(capsys, "memory", "--model", "llama3-8b", "--pp", "4", "--grad-accum", "2", "--json")
    assert code == 0
    assert err.startswith("warning: ") and "2 micro-batches per step (grad_accum) are fewer than the 4" in err
    layout = Layout(pp=4, grad_accum=2)
    expected = max(m.peak_bytes for m in estimate_memory_per_rank(LLAMA8B, layout, fill_pipeline=False))
    assert json.loads(out)["peak_bytes"] == expected
    # the first rank holds both micro-batches' activations at once, not the 4 a full 1F1B would
    full = estimate_memory_per_rank(LLAMA8B, replace(layout, grad_accum=4))[0]
    assert estimate_memory_per_rank(LLAMA8B, layout, fill_pipeline=False)[0].activations < full.activations


def test_user_errors_are_one_line_each(capsys):
    code, _, err = run_plan(capsys, "memory", "--model", "llama3-8b", "--tp", "3", "--pp", "64")
    assert code == 2
    lines = [line for line in err.strip().splitlines() if not line.startswith("warning: ")]
    assert all(line.startswith("error: ") for line in lines) and len(lines) == 2
    assert "tp=3 does not divide n_heads=32" in err and "pp=64 exceeds n_layers=32" in err
    code, _, err = run_plan(capsys, "memory", "--n-layers", "2")
    assert code == 2 and "without --model these are needed: --dim" in err
    code, _, err = run_plan(capsys, "search", "--model", "llama3-8b", "--gpu", "tpu-v9", "--gpus", "8",
                            "--batch-tokens", "1048576", "--seq", "8192")
    assert code == 2 and "unknown GPU 'tpu-v9'" in err
    code, _, err = run_plan(capsys, "scaling", "--mfu", "2")
    assert code == 2 and "--mfu must lie in (0, 1]" in err and "give a budget" in err


def test_scaling_json(capsys):
    code, out, _ = run_plan(capsys, "scaling", "--flops", "5.76e23", "--gpus", "1024", "--gpu", "h100-sxm",
                            "--mfu", "0.4", "--price-per-gpu-hour", "2", "--json")
    data = json.loads(out)
    rows = {row["method"]: row for row in data["rows"]}
    assert code == 0 and set(rows) == {"epoch", "hoffmann", "20 tokens/param"}
    assert rows["20 tokens/param"]["active_params"] == pytest.approx(69.3e9, rel=0.01)
    assert rows["20 tokens/param"]["tokens"] == pytest.approx(1.39e12, rel=0.01)
    assert 15 < rows["epoch"]["tokens_per_param"] < 25
    days = 5.76e23 / (1024 * 0.4 * 989.4e12) / 86400
    assert rows["epoch"]["days"] == pytest.approx(days)
    assert rows["epoch"]["cost_usd"] == pytest.approx(days * 24 * 1024 * 2)
    assert rows["epoch"]["checkpoint_bytes"] == pytest.approx(14 * rows["epoch"]["total_params"])


def test_scaling_moe_follows_active_params_for_time_and_total_for_checkpoints(capsys):
    code, out, _ = run_plan(capsys, "scaling", "--params", "37e9", "--total-params", "671e9", "--tokens",
                            "14.8e12", "--gpus", "2048", "--json")
    row = json.loads(out)["rows"][0]
    assert row["flops"] == pytest.approx(6 * 37e9 * 14.8e12)
    assert row["checkpoint_bytes"] == pytest.approx(14 * 671e9)


def test_search_writes_a_loadable_config_and_says_when_nothing_fits(capsys, tmp_path):
    out_path = tmp_path / "best.toml"
    code, out, _ = run_plan(capsys, "search", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "8",
                            "--batch-tokens", "1048576", "--seq", "8192", "--out", str(out_path), "--top", "2")
    assert code == 0 and "#1 " in out and "   - fits: " in out
    cfg = load_config(out_path)
    assert cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp == 8
    code, out, _ = run_plan(capsys, "search", "--model", "llama3-70b", "--gpu", "a100-80gb", "--gpus", "8",
                            "--batch-tokens", "1048576", "--seq", "4096", "--out", str(tmp_path / "none.toml"))
    assert code == 1 and "nothing fits" in out and not (tmp_path / "none.toml").exists()


def test_plan_memory_prices_an_underfilled_pipeline_and_warns_with_the_configs_own_line(capsys):
    # 2 micro-batches cannot fill 4 stages: the config refuses it, plan memory prices it (it runs, mostly
    # idle) and says why with the same line (rules.pipeline_fill_problem)
    code, out, err = run_plan(capsys, "memory", "--model", "llama3-8b", "--pp", "4", "--grad-acc", "2", "--seq", "4096")
    assert code == 0 and "GiB" in out
    assert "2 micro-batches per step (grad_accum) are fewer than the 4 pipeline stages: pp_schedule=1f1b needs at " \
           "least 4 to fill the pipeline; estimated as it would run, mostly idle" in err
    code, _, err = run_plan(capsys, "memory", "--model", "llama3-8b", "--pp", "4", "--grad-acc", "4", "--seq", "4096")
    assert code == 0 and "fill the pipeline" not in err
