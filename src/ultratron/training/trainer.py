"""The training loop: one optimizer step = grad-accum micro-batches → clip → AdamW → log.

Shaped for the distributed work to plug in without rewriting the loop: the data loader knows
its dp rank from the start, the model is wrapped by `parallelize` from outside, and the global
quantities (loss, gradient norm) each come from one function that a parallel layout can replace.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ultratron.checkpoint.manager import (
    CheckpointManager,
    load_checkpoint,
    resolve_checkpoint_dir,
    rng_state,
    set_rng_state,
)
from ultratron.config import Config, to_dict, to_toml
from ultratron.data.loader import TokenLoader
from ultratron.data.prepare import prepare_data
from ultratron.data.shards import ShardSet
from ultratron.errors import CheckpointError, DataError
from ultratron.models.llama import build_model
from ultratron.parallel import runtime
from ultratron.parallel.dims import ParallelDims
from ultratron.parallel.parallelize import micro_batch, parallelize
from ultratron.planning.flops import mfu, training_flops_per_token
from ultratron.planning.params import count_params_of
from ultratron.training.loss import cross_entropy
from ultratron.training.metrics import MetricsWriter, RunLog, truncate_metrics
from ultratron.training.optim import build_optimizer, lr_at, set_lr
from ultratron.training.precision import autocast


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DataError("training.device=cuda but no CUDA device is available; use auto or cpu")
    return torch.device(name)


@dataclass
class TrainResult:
    run_dir: Path
    steps_done: int
    first_loss: float | None
    final_loss: float | None
    first_val_loss: float | None
    final_val_loss: float | None
    sample: str | None
    checkpoint: Path | None
    peak_source: str


class Trainer:
    def __init__(self, cfg: Config, echo: bool = True):
        self.cfg = cfg
        self.dims = ParallelDims.from_config(cfg.parallel, cfg.model)
        self.run_dir = Path(cfg.run.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = RunLog(self.run_dir, echo=echo) if self.dims.is_main else runtime.QuietLog()
        t = cfg.training
        if t.threads > 0:
            torch.set_num_threads(t.threads)
        self.device = self.dims.init_distributed(pick_device(t.device))
        torch.manual_seed(t.seed)

        data_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else self.run_dir / "data"
        self.data = runtime.main_first(self.dims, lambda: prepare_data(cfg.data, cfg.model.vocab_size, data_dir,
                                                                      log=self.log))
        self.tokenizer = self.data.tokenizer
        loader_args = dict(seq_len=t.seq_len, dp_rank=self.dims.dp_rank, dp_world=cfg.parallel.dp, seed=t.seed)
        self.train_loader = TokenLoader(ShardSet.open(self.data.train_dir),
                                        micro_batch_size=t.micro_batch_size, **loader_args)
        self.val_shards = ShardSet.open(self.data.val_dir) if self.data.val_dir else None

        self.model = build_model(cfg.model, self.device)
        self.model = parallelize(self.model, self.dims, cfg)
        self.optimizer = runtime.wrap_optimizer(build_optimizer(self.model, cfg.optim), self.dims)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep=cfg.checkpoint.keep)
        self.step = 0

        counts = count_params_of(cfg.model)
        self.n_params = counts.total
        self.flops_per_token = training_flops_per_token(
            counts, vocab_size=cfg.model.vocab_size, dim=cfg.model.dim, n_layers=cfg.model.n_layers,
            seq_len=t.seq_len)
        from ultratron.planning.hardware import peak_flops

        self.peak_flops, self.peak_source = peak_flops(self._device_name(), t.precision)
        self._peak_refreshed = False
        if self.dims.is_main:
            (self.run_dir / "config.toml").write_text(to_toml(cfg), encoding="utf-8")

    def _device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        state = {"step": self.step, "loader": self.train_loader.state_dict(), "rng": rng_state(),
                 "config": to_dict(self.cfg)}
        if self.dims.distributed:
            path = runtime.save_sharded(self, state)
        else:
            path = self.checkpoints.save(
                self.step, model_state=self.model.state_dict(), optimizer_state=self.optimizer.state_dict(),
                state=state, config_toml=to_toml(self.cfg), tokenizer_json=self.tokenizer.to_json())
        self.log(f"checkpoint: saved step {self.step} to {path}")
        return path

    def maybe_resume(self) -> None:
        resume = self.cfg.checkpoint.resume
        if resume == "none":
            existing = self.checkpoints.latest()
            if existing is not None:
                raise CheckpointError(
                    f"run.dir {str(self.run_dir)!r} already holds checkpoints (latest: {existing.name}); "
                    "pass --checkpoint.resume auto to continue that run, or choose a new --run.dir")
            truncate_metrics(self.run_dir, -1)  # a fresh start: drop records of an earlier attempt
            return
        path = self.checkpoints.latest() if resume == "auto" else resume
        if path is None:
            self.log("checkpoint: resume=auto found no checkpoint; starting from step 0")
            truncate_metrics(self.run_dir, -1)
            return
        ckpt = resolve_checkpoint_dir(path)
        state = runtime.load_parallel(self, ckpt)
        if state is None:  # a one-process checkpoint into a one-process run
            parts = load_checkpoint(ckpt, map_location=self.device)
            try:
                self.model.load_state_dict(parts["model"])
            except RuntimeError as err:
                raise CheckpointError(f"{ckpt}: model weights do not fit this model.* config "
                                      f"({str(err).splitlines()[0]})") from None
            self.optimizer.load_state_dict(parts["optimizer"])
            state = parts["state"]
        self.train_loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        if self.dims.is_main:
            truncate_metrics(self.run_dir, self.step)
        self.log(f"checkpoint: resumed from {ckpt} at step {self.step}")

    # ---- one step ------------------------------------------------------------------------------
    def train_step(self) -> dict:
        cfg = self.cfg
        self.model.train()
        lr = lr_at(self.step, cfg.training.steps, cfg.optim)
        set_lr(self.optimizer, lr)
        accum = cfg.grad_accum_steps
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(accum):
            inputs, targets = (t.to(self.device, non_blocking=True) for t in self.train_loader.next_batch())
            with micro_batch(self.model, self.dims, last=micro == accum - 1):
                with autocast(cfg.training.precision, self.device):
                    logits = self.model(inputs)
                loss, ce = cross_entropy(logits, targets, cfg.training.z_loss)
                (loss / accum).backward()
            loss_sum += runtime.local_value(ce.detach())
        max_norm = cfg.training.grad_clip if cfg.training.grad_clip > 0 else math.inf
        grad_norm = runtime.clip_grad_norm(self.model.parameters(), max_norm)
        loss_sum = runtime.average_over_dp(loss_sum, self.dims)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"loss": float(loss_sum / accum), "grad_norm": float(grad_norm), "lr": lr}

    @torch.no_grad()
    def validate(self) -> float | None:
        if self.val_shards is None:
            return None
        t = self.cfg.training
        try:
            loader = TokenLoader(self.val_shards, seq_len=t.seq_len, micro_batch_size=t.micro_batch_size,
                                 seed=t.seed)
        except DataError:
            return None  # held-out split shorter than one micro-batch
        self.model.eval()
        batches = min(self.cfg.eval.batches, loader.n_sequences // t.micro_batch_size)
        total = 0.0
        for _ in range(batches):
            inputs, targets = (x.to(self.device) for x in loader.next_batch())
            with autocast(t.precision, self.device):
                logits = self.model(inputs)
            total += float(cross_entropy(logits, targets)[1])
        return total / batches

    # ---- the loop ------------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        cfg, t = self.cfg, self.cfg.training
        self.maybe_resume()
        runtime.barrier(self.dims)  # every rank has resumed (and trimmed metrics) before rank 0 logs
        self.log(f"model: {self.n_params:,} parameters; {self.flops_per_token:.3g} training FLOPs/token; "
                 f"batch {t.batch_tokens:,} tokens = {cfg.grad_accum_steps} × {t.micro_batch_size} × {t.seq_len}"
                 f"{f' × dp {cfg.parallel.dp}' if cfg.parallel.dp > 1 else ''}; device {self.device}; "
                 f"precision {t.precision}")
        self.log(f"mfu: peak {self.peak_flops / 1e12:.3g} TFLOP/s ({self.peak_source})")
        metrics = (MetricsWriter(self.run_dir, tensorboard=cfg.run.tensorboard) if self.dims.is_main
                   else runtime.QuietMetrics())
        first_loss = final_loss = first_val = final_val = None
        if self.step == 0 and cfg.eval.interval > 0:
            first_val = self.validate()
            if first_val is not None:
                metrics.write({"step": 0, "val_loss": first_val})
                self.log(f"step 0: validation loss {first_val:.4f}")
        stop_at = t.steps if t.stop_after <= 0 else min(t.steps, self.step + t.stop_after)
        bar = self._progress_bar(stop_at)
        last_ckpt = None
        from ultratron.evaluation.periodic import PeriodicEvaluator

        periodic = PeriodicEvaluator(cfg, self.run_dir, self.log, enabled=not self.dims.distributed)
        try:
            while self.step < stop_at:
                start = time.perf_counter()
                record = self.train_step()
                elapsed = time.perf_counter() - start
                tokens_per_sec = t.batch_tokens / elapsed
                self._check_peak(tokens_per_sec / self.dims.world_size)
                record = {"step": self.step, **record, "tokens": self.step * t.batch_tokens,
                          "tokens_per_sec": tokens_per_sec, "step_time": elapsed,
                          "mfu": mfu(tokens_per_sec / self.dims.world_size, self.flops_per_token, self.peak_flops)}
                if not math.isfinite(record["loss"]):
                    raise FloatingPointError(f"loss is {record['loss']} at step {self.step}; lower optim.lr "
                                             "or enable training.grad_clip")
                first_loss = record["loss"] if first_loss is None else first_loss
                final_loss = record["loss"]
                at_end = self.step == t.steps
                if cfg.eval.interval > 0 and (self.step % cfg.eval.interval == 0 or at_end):
                    val = self.validate()
                    if val is not None:
                        record["val_loss"] = final_val = val
                        self.log(f"step {self.step}: validation loss {val:.4f}")
                metrics.write(record)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}",
                                    tok_s=f"{tokens_per_sec:,.0f}", mfu=f"{record['mfu']:.0%}")
                elif t.log_interval > 0 and self.step % t.log_interval == 0:
                    self.log(f"step {self.step}: loss {record['loss']:.4f} grad_norm {record['grad_norm']:.3f} "
                             f"lr {record['lr']:.2e} {tokens_per_sec:,.0f} tok/s mfu {record['mfu']:.1%}")
                interval = cfg.checkpoint.interval
                if (interval > 0 and self.step % interval == 0) or self.step == stop_at:
                    last_ckpt = self.save_checkpoint()
                periodic.after_step(self, metrics, last_ckpt)  # task evaluation in a child process
            for record in periodic.finish(cfg.eval.final_wait, self, last_ckpt):
                metrics.write(record)
        finally:
            periodic.close()
            if bar is not None:
                bar.close()
                self.log._writer = None
            metrics.close()
        sample = self.sample() if self.step == t.steps and t.sample_tokens > 0 else None
        self.log.close()
        return TrainResult(self.run_dir, self.step, first_loss, final_loss, first_val, final_val, sample,
                           last_ckpt, self.peak_source)

    def _check_peak(self, tokens_per_sec_per_device: float) -> None:
        """A measured CPU peak that training itself exceeds was taken while the CPU was busy:
        measure it again (once) rather than report an MFU above 100%."""
        achieved = tokens_per_sec_per_device * self.flops_per_token
        if self.device.type != "cpu" or achieved <= self.peak_flops or self._peak_refreshed:
            return
        from ultratron.planning.hardware import peak_flops

        self._peak_refreshed = True
        old = self.peak_flops
        self.peak_flops, self.peak_source = peak_flops("cpu", self.cfg.training.precision, refresh=True)
        self.log(f"mfu: training reached {achieved / 1e9:.0f} GFLOP/s, above the cached peak of {old / 1e9:.0f}; "
                 f"re-measured the peak: {self.peak_flops / 1e9:.0f} GFLOP/s")

    def _progress_bar(self, stop_at: int):
        if not self.cfg.training.progress or self.step >= stop_at or not self.dims.is_main:
            return None
        from tqdm import tqdm

        bar = tqdm(total=stop_at, initial=self.step, desc="train", unit="step", dynamic_ncols=True)
        self.log._writer = tqdm
        return bar

    @torch.no_grad()
    def sample(self, prompt: str = "def") -> str:
        from ultratron.serving.generate import generate

        self.model.eval()
        ids = generate(self.model, self.tokenizer.encode(prompt), self.cfg.training.sample_tokens,
                       stop_id=self.tokenizer.eos_id, seed=self.cfg.training.seed)
        text = prompt + self.tokenizer.decode(ids)
        self.log("sample:\n" + text)
        return text


def train(cfg: Config, echo: bool = True) -> TrainResult:
    return Trainer(cfg, echo=echo).fit()
