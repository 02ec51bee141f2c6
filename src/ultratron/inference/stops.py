"""Where a generated text stops, for the engine (which ends a sequence there) and for the endpoint
evaluator (which cuts an answer at the stop strings an OpenAI API would not take). No torch: the
endpoint evaluator imports none."""

from __future__ import annotations


def first_stop(text: str, stops) -> int:
    """Where the first occurrence of any of `stops` (empty ones aside) starts in `text`, or -1."""
    return min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
