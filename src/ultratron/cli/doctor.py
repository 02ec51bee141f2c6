"""Say why a distributed run failed or hung, from the flight records its ranks left.

  ultratron doctor RUN_DIR

Each rank writes its last collectives to RUN_DIR/flight/rank-N.json when a collective times out
(parallel.collective_timeout), when another rank's failure breaks one, and on SIGTERM (the
launcher stopping the job). One line per finding: which rank failed, which ranks are behind and
in which collective (op, process group, call number), which rank never arrived or came late.
Exit 0 when there was something to read, 1 when there were no records.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run directory (its flight/ holds the records)")


def run(args) -> int:
    from pathlib import Path

    from ultratron.parallel.hangs import FLIGHT_DIR, findings

    lines = findings(args.run_dir)
    for line in lines:
        print(line)
    return 0 if any(Path(args.run_dir, FLIGHT_DIR).glob("rank-*.json")) else 1
