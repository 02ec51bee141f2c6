"""Evaluate a checkpoint, or any OpenAI-compatible endpoint, on task suites.

  ultratron eval --checkpoint RUN/checkpoints/latest --tasks builtin
  ultratron eval --endpoint http://127.0.0.1:8000/v1 --model NAME --tasks builtin_next_line,my_task.jsonl

Prints a results table; --json FILE also writes every number (and the request/cost counter
for endpoints). Task files: see docs/evaluation.md.
"""

from __future__ import annotations

import argparse

from ultratron.config.inference import EvalSettings
from ultratron.config.loader import add_arguments as add_settings
from ultratron.config.loader import choice_problems, from_arguments
from ultratron.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, EvalSettings)


def run(args: argparse.Namespace) -> int:
    s: EvalSettings = from_arguments(EvalSettings, args)
    if (s.checkpoint is None) == (s.endpoint is None):
        raise ConfigError("give one of --checkpoint (a local model) or --endpoint (an OpenAI-compatible API)")
    if problems := choice_problems(s):
        raise ConfigError(problems)
    from ultratron.evaluation.backends import EndpointBackend, LocalBackend
    from ultratron.evaluation.builtin import checked_fraction, resolve_tasks, suite_fraction
    from ultratron.evaluation.runner import evaluate, flat_metrics, format_table, write_json

    if s.threads > 0 and s.checkpoint:  # (an endpoint's evaluation computes nothing here: no torch)
        import torch

        torch.set_num_threads(s.threads)
    backend = LocalBackend.from_checkpoint(s.checkpoint, s.device, s.checkpoint_endpoint) if s.checkpoint \
        else EndpointBackend.from_config(s)
    # the built-in suite from the run's own held-out split (its config.toml, or --held-out-fraction for
    # a run behind an endpoint), never its training files
    fraction = suite_fraction(getattr(backend, "config", None)) if s.held_out_fraction is None \
        else checked_fraction(s.held_out_fraction)
    tasks = resolve_tasks(s.tasks, fraction)
    results = evaluate(backend, tasks, s.max_examples or None, details=s.details)
    record = {"backend": backend.describe(), "step": s.step if s.step is not None else getattr(backend, "step", None),
              "tasks": results, "metrics": flat_metrics(results)}
    if s.checkpoint:
        record["checkpoint"] = str(s.checkpoint)
    if hasattr(backend, "usage"):
        record["usage"] = backend.usage.summary()
    if not s.quiet:
        print(format_table(results))
        if "usage" in record:
            u = record["usage"]
            print(f"requests {u['requests']} (failed {u['failed_requests']}), prompt tokens {u['prompt_tokens']}, "
                  f"completion tokens {u['completion_tokens']}, cost {u['cost']:.4f}")
    if s.json:
        write_json(s.json, record)
    return 0
