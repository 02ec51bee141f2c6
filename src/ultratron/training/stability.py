"""The loss-spike guard: a step whose loss or gradient norm is NaN/Inf updates nothing; a loss
spike rolls the run back to the last good checkpoint and skips the data that caused it.

- Non-finite loss or gradient norm → the optimizer step is skipped (the batch is consumed, the
  step counted as `skipped`). More than `max_skips_in_a_row` in a row is treated as a spike.
- Spike: the loss exceeds its recent level (the median of the last five good steps) by more
  than K × the noise (the median absolute deviation of the step-to-step changes over the last
  `window` steps), and by at least `loss_min_rise` of the level; or the gradient norm exceeds
  `grad_factor` × its running median. Measuring the noise on the changes, not on the losses
  themselves, keeps early training's steady fall from passing for noise.
  The run loads the newest verified checkpoint older than the spike, and the data loader is set
  to where it stood after the spike, so the window of batches between the checkpoint and the
  spike is never trained on again. This is PaLM's recipe (Chowdhery et al. 2022, §5.1: restart
  from a checkpoint about 100 steps before the spike and skip roughly 200–500 batches; the spike
  did not recur), done automatically: the window is what lies between the checkpoint and the
  spike, so `checkpoint.interval` bounds it.
- After `max_rollbacks` rollbacks training stops with a report of every event.

Every rank sees the same loss (averaged over data parallelism) and the same global gradient
norm, so every rank takes the same decision without talking to the others.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from itertools import pairwise

from ultratron.errors import TrainingError

RECENT = 5  # steps whose median is the loss's current level


def median_and_mad(values: list[float]) -> tuple[float, float]:
    """The median and the median absolute deviation (unscaled) of `values`."""
    median = statistics.median(values)
    return median, statistics.median(abs(v - median) for v in values)


def loss_threshold(losses: list[float], k: float, min_rise: float) -> tuple[float, float, float]:
    """(threshold, level, noise) for the next loss, from the good losses before it (at least 2)."""
    level = statistics.median(losses[-RECENT:])
    _, noise = median_and_mad([b - a for a, b in pairwise(losses)])
    return level + max(k * noise, min_rise * abs(level)), level, noise


class StabilityGuard:
    def __init__(self, cfg, checkpoints, loader, log):
        self.s = cfg.stability
        self.checkpoints, self.loader, self.log = checkpoints, loader, log
        self.history: deque = deque(maxlen=max(1, self.s.window))  # (step, loss, grad_norm) of good steps
        self.skipped = 0
        self.skips_in_a_row = 0
        self.rollbacks = 0
        self.events: list[str] = []

    # ---- before the optimizer step ------------------------------------------------------------
    def skip_update(self, step: int, loss: float, grad_norm: float) -> bool:
        """True when step `step` must not update the weights (its loss or gradients are not finite)."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.skips_in_a_row = 0
            return False
        if not self.s.skip_nonfinite:
            raise TrainingError(f"loss {loss}, gradient norm {grad_norm} at step {step}; lower optim.lr or "
                                "enable training.grad_clip (or set stability.skip_nonfinite true to skip such steps)")
        self.skipped += 1
        self.skips_in_a_row += 1
        self._event(f"step {step}: loss {loss}, gradient norm {grad_norm}: not finite, the update is skipped "
                    f"({self.skipped} skipped so far)")
        return True

    # ---- after the step -----------------------------------------------------------------------
    def spike(self, record: dict) -> str | None:
        """Why `record`'s step is a spike, or None (then it joins the running window)."""
        if record.get("skipped"):
            if self.skips_in_a_row > self.s.max_skips_in_a_row:
                return f"{self.skips_in_a_row} non-finite steps in a row"
            return None
        loss, grad_norm = record["loss"], record["grad_norm"]
        if len(self.history) >= max(2, self.s.min_steps):
            threshold, level, noise = loss_threshold([h[1] for h in self.history], self.s.loss_mad,
                                                     self.s.loss_min_rise)
            if self.s.loss_mad > 0 and loss > threshold:
                return (f"loss {loss:.4f} above its recent level {level:.4f} + {self.s.loss_mad:g} × the noise "
                        f"{noise:.4f} (threshold {threshold:.4f})")
            grad_median = statistics.median(h[2] for h in self.history)
            if self.s.grad_factor > 0 and grad_norm > self.s.grad_factor * grad_median:
                return (f"gradient norm {grad_norm:.3f} above {self.s.grad_factor:g} × its running median "
                        f"{grad_median:.3f}")
        self.history.append((record["step"], loss, grad_norm))
        return None

    def after_step(self, record: dict) -> bool:
        """The trainer's call after each step: True when the step was rolled back (then it is not
        reported, saved or evaluated: the run is back at an earlier step)."""
        reason = self.spike(record)
        if reason is None:
            return False
        step = record["step"]
        if self.s.max_rollbacks == 0:
            self._event(f"step {step}: spike ({reason}); rollbacks are disabled (stability.max_rollbacks 0)")
            record["spike"] = 1
            return False
        if self.rollbacks >= self.s.max_rollbacks:
            self._event(f"step {step}: spike ({reason}); that is one more than stability.max_rollbacks "
                        f"{self.s.max_rollbacks}, so training stops")
            raise TrainingError(["training is unstable: it kept spiking after the rollbacks it may make; "
                                 "lower optim.lr, raise optim.warmup_steps, or inspect the data. Events:",
                                 *self.events])
        return self._roll_back(step, reason)

    def _roll_back(self, step: int, reason: str) -> bool:
        past_window = self.loader.state_dict()  # where the data stands after the spike's batches
        to = self.checkpoints.rollback(before_step=step)
        if to is None:
            self._event(f"step {step}: spike ({reason}); no checkpoint before it to roll back to, training goes on")
            return False
        self.loader.load_state_dict(past_window)
        self.rollbacks += 1
        while self.history and self.history[-1][0] > to:
            self.history.pop()
        self.skips_in_a_row = 0
        self._event(f"step {step}: spike ({reason}); rolled back to step {to} and skipped the data of steps "
                    f"{to + 1}–{step} (rollback {self.rollbacks} of at most {self.s.max_rollbacks})")
        self.log.rewind(to)
        self.log.record({"step": to, "rollback": self.rollbacks, "spike_step": step, "skipped_data_steps": step - to})
        return True

    def _event(self, message: str) -> None:
        self.events.append(message)
        self.log(f"stability: {message}")
