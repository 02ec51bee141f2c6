"""Pipeline layouts are checked with the config, before any process group starts: one `error:` line
per problem, exit 2, no traceback. Each command below runs as rank 0 of a two-process torchrun
launch whose other rank never comes: had validation passed, joining the process group would wait
for it (and time out), so a prompt exit 2 shows nothing was started."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import TINY
from ultratron.config import load_config
from ultratron.errors import ConfigError
from ultratron.launch.local import free_port

PP = ["--model.n_layers", "8", "--training.batch_tokens", "1024"]  # 4 micro-batches of 4 × 64 tokens

BAD = [
    (["--parallel.pp", "2", "--model.n_layers", "1"], "parallel.pp=2 exceeds model.n_layers=1"),
    (["--parallel.pp", "4", "--training.batch_tokens", "512"],
     "2 micro-batches per step (training.batch_tokens ÷ (micro_batch_size × seq_len × dp)) are fewer than the "
     "4 pipeline stages: parallel.pp_schedule=1f1b needs at least 4 to fill the pipeline"),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "interleaved-1f1b", "--parallel.pp_virtual_stages", "3"],
     "parallel.pp=2 × 3 stages per rank = 6 stages do not divide model.n_layers=8"),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "dualpipev", "--training.batch_tokens", "768"],
     "3 micro-batches per step (training.batch_tokens ÷ (micro_batch_size × seq_len × dp)) are fewer than the "
     "4 stages: parallel.pp_schedule=dualpipev needs at least 4"),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "zb", "--training.batch_tokens", "1280"],
     "5 micro-batches per step (training.batch_tokens ÷ (micro_batch_size × seq_len × dp)): "
     "parallel.pp_schedule=zb runs them in 2 rounds"),
    (["--parallel.pp", "2", "--parallel.pp_virtual_stages", "2"],
     "parallel.pp_virtual_stages=2 needs a schedule with several stages per rank"),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "zbv", "--parallel.pp_virtual_stages", "4"],
     "parallel.pp_schedule=zbv runs exactly 2 stages per rank (a V)"),
    (["--parallel.pp", "2", "--parallel.pp_split", "3,4"], "parallel.pp_split='3,4' adds up to 7 layers"),
    (["--parallel.pp", "2", "--parallel.pp_split", "2,2,4"], "has 3 entries; the pipeline has 2 stages"),
    (["--parallel.pp", "2", "--parallel.pp_split", "8,x"], "must list positive layer counts"),
    (["--parallel.pp_split", "4,4"], "parallel.pp_split=4,4 needs parallel.pp > 1"),
    (["--parallel.pp", "2", "--parallel.dp", "2", "--parallel.zero", "3", "--parallel.pp_schedule", "zbv",
      "--training.batch_tokens", "2048"], "parallel.zero=3 frees the gathered parameters after each forward"),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "dualpipev", "--training.recompute", "selective"],
     "training.recompute=selective lets each recomputed region run backward once"),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "zigzag"], "parallel.pp_schedule"),
]


@pytest.mark.parametrize("args,expected", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_pipeline_layout_is_one_error_line_before_any_process_group(args, expected, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "ultratron", "train", *TINY, *PP, *args, "--run.dir", str(run)],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
    assert not run.exists()


def test_good_pipeline_layouts_validate():
    for args in (["--parallel.pp", "2"], ["--parallel.pp", "4", "--parallel.pp_schedule", "gpipe"],
                 ["--parallel.pp", "2", "--parallel.pp_schedule", "interleaved-1f1b",
                  "--parallel.pp_virtual_stages", "4"],
                 ["--parallel.pp", "2", "--parallel.pp_schedule", "zbv", "--parallel.pp_split", "1,3,3,1"],
                 ["--parallel.pp", "2", "--parallel.dp", "2", "--parallel.zero", "3",
                  "--training.batch_tokens", "2048"]):
        cfg = load_config(None, TINY + PP + args)
        assert cfg.parallel.pp > 1


def test_several_pipeline_problems_are_reported_together():
    with pytest.raises(ConfigError) as err:
        load_config(None, TINY + PP + ["--parallel.pp", "4", "--parallel.pp_schedule", "interleaved-1f1b",
                                       "--parallel.pp_virtual_stages", "3", "--training.batch_tokens", "512"])
    assert len(err.value.problems) == 2
