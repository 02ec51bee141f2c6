"""Draw a run's curves into one PNG: loss and validation loss, gradient norm, learning rate, tokens/s.

  ultratron report RUN_DIR [--out FILE]     (default: RUN_DIR/report.png)
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (holds metrics.jsonl)")
    parser.add_argument("--out", help="where to write the PNG (default RUN_DIR/report.png)")


def run(args) -> int:
    from ultratron.training.report import draw_report

    print(draw_report(args.run_dir, args.out))
    return 0
