"""The server's Prometheus metrics (`GET /metrics`, text exposition format 0.0.4), written by hand:
counters and histograms need nothing more than a lock and a few lines of text.

The HTTP layer counts requests by endpoint and status; the batcher's worker thread counts tokens
and times each sequence: time to first token from its submission, time per output token after the
first. Gauges are read when scraped: the queue, the running sequences, the KV cache, and whatever
numbers the engine reports in `Engine.stats()` (prefix-cache hits, prompt tokens computed, ...),
each as `ultratron_engine_<name>`, so counters the engine adds later appear without a change here.
"""

from __future__ import annotations

import math
import threading

PREFIX = "ultratron"
# seconds: 1 ms to 1 min, roughly ×2.5 apart (Prometheus' default buckets, extended down for decode steps)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # observations <= each bound (cumulative when rendered)
        self.count, self.sum = 0, 0.0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        self.count += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.buckets, self.counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}", f"{name}_count {self.count}"]
        return out


class Metrics:
    """Thread-safe counters the event loop and the worker thread both write."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.generation_tokens = self.sequences = self.aborted = 0
        self.ttft, self.tpot = Histogram(), Histogram()

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[endpoint, status] = self.requests.get((endpoint, status), 0) + 1

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def finished(self, prompt_tokens: int, tokens: int, decode_seconds: float | None, aborted: bool) -> None:
        """A sequence is done: its tokens, and (with two tokens or more) the time per token after the first."""
        with self._lock:
            self.sequences += 1
            self.aborted += aborted
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += tokens
            if decode_seconds is not None and tokens > 1:
                self.tpot.observe(decode_seconds / (tokens - 1))

    def render(self, gauges: dict[str, tuple[float, str]], engine: dict[str, float]) -> str:
        """The exposition text: counters and histograms, then `gauges` {name: (value, help)} and the
        engine's numbers."""
        p = PREFIX
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {p}_{name} {help_}", f"# TYPE {p}_{name} {kind}", *samples])

        with self._lock:
            metric("requests_total", "counter", "HTTP requests answered, by endpoint and status code",
                   [f'{p}_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                    for (e, s), n in sorted(self.requests.items())])
            metric("prompt_tokens_total", "counter", "prompt tokens of the sequences served",
                   [f"{p}_prompt_tokens_total {self.prompt_tokens}"])
            metric("generation_tokens_total", "counter", "tokens generated",
                   [f"{p}_generation_tokens_total {self.generation_tokens}"])
            metric("sequences_finished_total", "counter", "sequences done (a request has n per prompt)",
                   [f"{p}_sequences_finished_total {self.sequences}"])
            metric("sequences_aborted_total", "counter", "sequences stopped because the client left or timed out",
                   [f"{p}_sequences_aborted_total {self.aborted}"])
            metric("time_to_first_token_seconds", "histogram", "from submission to a sequence's first token",
                   self.ttft.lines(f"{p}_time_to_first_token_seconds"))
            metric("time_per_output_token_seconds", "histogram", "decode time per token after the first",
                   self.tpot.lines(f"{p}_time_per_output_token_seconds"))
        for name, (value, help_) in gauges.items():
            metric(name, "gauge", help_, [f"{p}_{name} {_number(value)}"])
        for name, value in sorted(flatten(engine).items()):
            key = "".join(c if c.isalnum() else "_" for c in name)
            metric(f"engine_{key}", "gauge", f"the engine's {name!r} (Engine.stats())",
                   [f"{p}_engine_{key} {_number(value)}"])
        return "\n".join(lines) + "\n"


def flatten(stats: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a nested dict, {"prefix_cache": {"hit_lookups": 3}} as {"prefix_cache_hit_lookups": 3}."""
    out: dict[str, float] = {}
    for name, value in stats.items():
        if isinstance(value, dict):
            out |= flatten(value, f"{prefix}{name}_")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[prefix + name] = value
    return out


def _number(value: float) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    return str(value)


def scrape(batcher) -> str:
    """/metrics' text for a serving Batcher: its counters, the queue, the KV cache, the engine's stats()."""
    engine = batcher.engine
    stats = engine.stats()
    gauges = {"waiting_sequences": (batcher.waiting, "sequences queued for a free slot"),
              "running_sequences": (len(engine.rows), "sequences being generated"),
              "kv_cache_usage_ratio": (_ratio(stats, "kv_tokens", "kv_capacity"),
                                       "share of the KV cache's positions that hold a sequence's tokens"),
              "kv_cache_bytes": (batcher.kv_bytes, "bytes of the paged KV cache's pool of blocks"),
              "prompt_tokens_computed_ratio": (
                  _ratio(stats, "computed_tokens", "prompt_tokens"),
                  "prompt tokens the model computed ÷ prompt tokens admitted (the rest came from the prefix cache)")}
    return batcher.metrics.render(gauges, stats)


def _ratio(stats: dict, part: str, whole: str) -> float:
    return stats[part] / stats[whole] if stats[whole] else 0.0
