"""Every command block of the README runs as written and exits 0 — in order, in one fresh
directory, as a new user would paste them. Only the sizes are shortened, by flags appended to
the commands (later --section.field flags win), so the whole tour takes a few minutes on 2 cores.

The README's two set-up commands are `make test` (this suite itself, what CI runs) and `make
quickstart` (`ultratron quickstart` with its full defaults, run here shortened); `source
.venv/bin/activate` is replaced by putting this interpreter's bin directory first on PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```bash\n(.*?)```", README, flags=re.S)

DATA = ["--data.max_bytes", "1500000"]  # tokenizer and shards from 1.5 MB of the built-in corpus
QUICK = [*DATA, "--training.steps", "6", "--training.batch_tokens", "2048", "--training.micro_batch_size", "8",
         "--training.seq_len", "128", "--eval.interval", "3", "--checkpoint.interval", "3",
         "--training.sample_tokens", "8"]
SHORT = [*DATA, "--training.steps", "3", "--training.batch_tokens", "2048", "--training.micro_batch_size", "4",
         "--training.seq_len", "128", "--eval.interval", "3", "--checkpoint.interval", "3",
         "--training.sample_tokens", "8"]


def shorten(line: str) -> str | None:
    """The command as the test runs it (None: not run here, see the module docstring)."""
    command = re.sub(r"\s+#\s.*$", "", line).strip()
    if not command or command.startswith(("make ", "source ")):
        return None
    background = command.endswith("&")
    command = command.removesuffix("&").rstrip()
    extra: list[str] = []
    if command.startswith("ultratron quickstart"):
        extra = QUICK
    elif (" ultratron train" in f" {command}" and "--show-config" not in command) or (
            command.startswith("ultratron launch") and "--slurm" not in command):
        extra = SHORT
        if "--eval.task_interval" in command:  # a task evaluation must actually run (and finish)
            extra = extra + ["--eval.task_interval", "3", "--eval.max_examples", "3"]
    elif command.startswith("ultratron eval"):
        extra = ["--max-examples", "3"]
    elif command.startswith("ultratron data run"):
        extra = ["--read.max_bytes", "400000"]
    command = " ".join([command, *extra])
    return command + " &" if background else command


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "configs", work / "configs")
    return work


def _env() -> dict[str, str]:
    # one torch thread a process, as torchrun gives each rank: `make test` runs two test files at once on
    # CI's 2 cores, and a single-process command on torch's default 2 threads then ran ~2x slower
    # than on one (measured side by side on a busy 2-core machine)
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}


def test_the_readme_has_its_command_blocks():
    assert len(BLOCKS) >= 5 and "make quickstart" in BLOCKS[0] and "make test" in BLOCKS[0]


@pytest.mark.parametrize("index", range(1, len(BLOCKS)))
def test_command_block_exits_zero(workdir, index):
    lines = [c for c in (shorten(line) for line in BLOCKS[index].splitlines()) if c]
    # a server started in the background must not outlive a failing block
    script = "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + "\n".join(lines) + "\n"
    result = subprocess.run(["bash", "-c", script], cwd=workdir, env=_env(), capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, f"{script}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}"
    if "torchrun" in script:  # the end-of-run sample under tensor + sequence parallel
        assert "sample:\ndef" in (workdir / "runs" / "d" / "train.log").read_text()


def test_the_config_error_shown_in_the_readme_is_what_the_command_prints(workdir):
    shown = re.search(r"```console\n\$ (.*?)\n(.*?)```", README, flags=re.S)
    command, expected = shown.group(1), shown.group(2).strip().splitlines()
    result = subprocess.run(["bash", "-c", command], cwd=workdir, env=_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == expected
