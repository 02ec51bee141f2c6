"""Train a model.

  ultratron train [--config FILE] [--section.field VALUE ...]

Every config field can be set as --section.field VALUE (sections: model, parallel, training,
optim, data, checkpoint, stability, health, eval, run), e.g.

  ultratron train --model.preset tiny --training.steps 100 --run.dir runs/try1
  ultratron train --config configs/tiny.toml --training.precision bf16 --checkpoint.resume auto

Without --data.path the built-in corpus (the Python standard library) is used. The run
directory receives config.toml, metrics.jsonl, TensorBoard events, train.log and checkpoints/.
The same command runs under torchrun for any parallel layout.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ultratron.config import Config
    from ultratron.config.loader import describe_fields

    parser.add_argument("--config", help="a TOML config file; --section.field flags override it")
    parser.add_argument("--show-config", action="store_true", help="print the resolved config as TOML and exit")
    parser.epilog = "config fields (default):\n" + describe_fields(Config)
    parser.set_defaults(_accepts_overrides=True)


def run(args) -> int:
    from ultratron.config import load_config, to_toml

    cfg = load_config(args.config, args.overrides)
    if args.show_config:
        print(to_toml(cfg))
        return 0
    from ultratron.training.trainer import train

    result = train(cfg)
    if result.final_loss is not None and os.environ.get("RANK", "0") == "0":  # once under torchrun
        print(f"trained to step {result.steps_done}: loss {result.final_loss:.4f}"
              + (f", validation loss {result.final_val_loss:.4f}" if result.final_val_loss is not None else "")
              + (f"; {result.loss_tokens:,} tokens counted in the loss" if result.loss_tokens is not None else "")
              + f"; run directory {result.run_dir}")
    return 0
