"""The batch of each optimizer step: fixed, or ramped from a small start to the full batch.

GPT-3 (Brown et al. 2020) raised its batch linearly from 32k tokens to the full batch over the
first 4–12B tokens of training. `training.batch_ramp = {start = S, tokens = N}` does the same:
the step that begins after T tokens takes S + (B − S)·T/N tokens (B = training.batch_tokens),
rounded down to whole growth units, and B from T = N on. Sequences per micro-batch never
change; the number of micro-batches per step grows. The unit is one micro-batch on every
data-parallel rank (micro_batch_size × seq_len × dp tokens), or under pipeline parallelism pp of
them, so that every step's micro-batch count stays a multiple of pp, which every schedule runs
(config validation checks S against the layout).

The batch is a function of the tokens seen so far (`TrainState.tokens`), so a resumed run — or
one rolled back by the stability guard — continues the ramp exactly. With a ramp the run lasts
`training.steps × training.batch_tokens` tokens, taking more optimizer steps to get there, and the
learning-rate schedule follows tokens (`lr_at` at tokens ÷ B full-batch steps), so warmup and
decay fall at the same tokens whatever the ramp. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSchedule:
    full: int  # training.batch_tokens
    unit: int  # tokens of one micro-batch on every data-parallel rank
    grow_by: int = 1  # micro-batches per rank the ramp adds at a time (pp under pipeline parallel)
    start: int = 0  # the first step's tokens; 0: no ramp
    ramp_tokens: int = 0  # tokens over which the batch reaches `full`

    @classmethod
    def from_config(cls, cfg) -> BatchSchedule:
        t, ramp = cfg.training, cfg.training.batch_ramp
        unit = cfg.tokens_per_micro_batch * cfg.parallel.dp
        if not ramp:
            return cls(full=t.batch_tokens, unit=unit)
        return cls(full=t.batch_tokens, unit=unit, grow_by=max(1, cfg.parallel.pp),
                   start=int(ramp["start"]), ramp_tokens=int(ramp["tokens"]))

    @property
    def ramped(self) -> bool:
        return self.start > 0

    def tokens_at(self, seen: int) -> int:
        """Tokens of the step that begins after `seen` tokens."""
        if not self.ramped or seen >= self.ramp_tokens:
            return self.full
        step = self.unit * self.grow_by
        grown = (self.full - self.start) * seen // (self.ramp_tokens * step)  # whole units, rounded down
        return min(self.full, self.start + grown * step)

    def steps_to(self, seen: int, end: int) -> int:
        """Optimizer steps from `seen` tokens until at least `end` tokens are seen; one plateau of
        the ramp at a time, so it costs at most one iteration per batch size."""
        steps = 0
        while seen < end:
            batch = self.tokens_at(seen)
            change = self._next_change(seen) if self.ramped and seen < self.ramp_tokens else end
            n = -(-(min(change, end) - seen) // batch)  # steps until this batch size ends (or the run)
            steps, seen = steps + n, seen + n * batch
        return steps

    def _next_change(self, seen: int) -> int:
        """The fewest tokens seen at which `tokens_at` exceeds its value at `seen`."""
        step = self.unit * self.grow_by
        k = (self.full - self.start) * seen // (self.ramp_tokens * step) + 1
        at = -(-k * self.ramp_tokens * step // (self.full - self.start))
        return min(at, self.ramp_tokens)
