"""Evaluate a checkpoint, or any OpenAI-compatible endpoint, on task suites.

  ultratron eval --checkpoint RUN/checkpoints/latest --tasks builtin
  ultratron eval --endpoint http://127.0.0.1:8000/v1 --model NAME --tasks builtin_next_line,my_task.jsonl

Prints a results table; --json FILE also writes every number (and the request/cost counter
for endpoints). Task files: see docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--checkpoint", help="a checkpoint, checkpoints or run directory (local backend)")
    where.add_argument("--endpoint", help="base URL of an OpenAI-compatible API (…/v1)")
    parser.add_argument("--tasks", default="builtin", help="comma-separated: builtin, task names, task files")
    parser.add_argument("--max-examples", type=int, default=100, help="per task (0: all)")
    parser.add_argument("--model", help="endpoint: model id (default: the first listed by /v1/models)")
    parser.add_argument("--api-key-env", default="OPENAI_API_KEY", help="endpoint: env variable with the key")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--max-retries", type=int, default=3)
    parser.add_argument("--generation-api", choices=["chat", "completions"], default="chat",
                        help="endpoint: API used for generation tasks")
    parser.add_argument("--price-per-request", type=float, default=0.0)
    parser.add_argument("--price-per-1k-prompt-tokens", type=float, default=0.0)
    parser.add_argument("--price-per-1k-completion-tokens", type=float, default=0.0)
    parser.add_argument("--json", dest="json_out", help="write results here as JSON")
    parser.add_argument("--details", action="store_true", help="include per-example log-likelihoods/outputs")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--step", type=int, help="training step to record (default: the checkpoint's)")
    parser.add_argument("--quiet", action="store_true", help="no table")


def build_backend(args: argparse.Namespace):
    from ultratron.evaluation.backends import EndpointBackend, LocalBackend, UsageCounter

    if args.checkpoint:
        return LocalBackend.from_checkpoint(args.checkpoint, args.device)
    usage = UsageCounter(args.price_per_request, args.price_per_1k_prompt_tokens,
                         args.price_per_1k_completion_tokens)
    return EndpointBackend(args.endpoint, args.model, os.environ.get(args.api_key_env), concurrency=args.concurrency,
                           timeout=args.timeout, max_retries=args.max_retries, generation_api=args.generation_api,
                           usage=usage)


def run(args: argparse.Namespace) -> int:
    import torch

    from ultratron.evaluation.runner import evaluate, format_table, write_json
    from ultratron.evaluation.tasks import resolve_tasks

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    tasks = resolve_tasks(args.tasks)
    backend = build_backend(args)
    results = evaluate(backend, tasks, args.max_examples or None, details=args.details)
    record = {"backend": backend.describe(), "step": args.step if args.step is not None else getattr(
        backend, "step", None), "tasks": results}
    if args.checkpoint:
        record["checkpoint"] = str(args.checkpoint)
    if hasattr(backend, "usage"):
        record["usage"] = backend.usage.summary()
    if not args.quiet:
        print(format_table(results))
        if "usage" in record:
            u = record["usage"]
            print(f"requests {u['requests']} (failed {u['failed_requests']}), prompt tokens {u['prompt_tokens']}, "
                  f"completion tokens {u['completion_tokens']}, cost {u['cost']:.4f}")
    if args.json_out:
        write_json(args.json_out, record)
    return 0
