"""The training loop, made of components: a step strategy (forward and backward), validation,
checkpointing policy, reporting, the MFU meter and periodic evaluation. `fit()` is the algorithm;
each component owns one concern and can be read (and replaced) on its own.

Order of construction follows the one-way flow: config → dims/mesh → data → model → parallelize →
optimizer → step strategy → checkpointing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ultratron.checkpoint.manager import ModelState
from ultratron.config import Config, to_dict, to_toml
from ultratron.data.mixture import open_loader, source_loaders
from ultratron.data.prepare import prepare_data
from ultratron.errors import DeviceError
from ultratron.models.lora import LORA_FILE, count_trainable, is_adapter, lora_reference
from ultratron.models.registry import build_model
from ultratron.models.sampling import generate
from ultratron.parallel.parallelize import parallelize, topology
from ultratron.planning.flops import flops_per_token_of
from ultratron.planning.params import count_params_of
from ultratron.training.allocator import configure_host_allocator
from ultratron.training.batch_ramp import BatchSchedule
from ultratron.training.checkpointing import CheckpointPolicy, with_init_tokenizer
from ultratron.training.health import HealthMonitor
from ultratron.training.metrics import start_memory, write_memory_peak
from ultratron.training.mfu import MfuMeter
from ultratron.training.moe import RouterStats
from ultratron.training.optim import build_optimizer, lr_at, set_lr
from ultratron.training.periodic_eval import PeriodicEvaluator
from ultratron.training.precision import configure_matmuls, settle_precision
from ultratron.training.profiling import StepProfiler
from ultratron.training.progress import Reporter
from ultratron.training.stability import StabilityGuard
from ultratron.training.state import TrainState
from ultratron.training.step import TrainStep
from ultratron.training.validation import Validator


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceError("training.device=cuda but no CUDA device is available; use auto or cpu")
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
    loss_tokens: int | None = None  # of the positions trained on, those the loss counted (runs with a loss mask)


class Trainer:
    def __init__(self, cfg: Config, echo: bool = True):
        self.cfg, t = cfg, cfg.training
        self.start_memory: dict | None = None
        device = pick_device(t.device)
        if cfg.layout.zero == 3:  # gathered block by block: on a CPU mmapped, not fragmenting the heap (its
            configure_host_allocator(device)  # step-time cost, docs/performance.md, only where it buys memory)
        settle_precision(t, device)  # (auto: bf16 on a GPU, fp32 on a CPU)
        self.dims = topology(cfg.layout, cfg.parallel.collective_timeout)
        self.run_dir = Path(cfg.run.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = Reporter(self.run_dir, is_main=self.dims.is_main, tensorboard=cfg.run.tensorboard,
                            progress=t.progress, log_interval=t.log_interval, echo=echo, run_cfg=cfg.run,
                            config=to_dict(cfg))
        if t.threads > 0:
            torch.set_num_threads(t.threads)
        self.device = self.dims.init_distributed(device, self.run_dir)
        configure_matmuls(self.device)  # TF32 for fp32 matmuls on a GPU
        self.dims.watch(self.run_dir)  # SIGTERM writes this rank's last collectives to RUN_DIR/flight
        self.health = HealthMonitor(cfg, self.dims, self.device, self.run_dir, self.log)
        self.health.before_start(step=0)  # a failing GPU stops the run before any data is read
        torch.manual_seed(t.seed)

        data_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else self.run_dir / "data"
        data_cfg = with_init_tokenizer(cfg.data, cfg.model.init_from)
        self.data = self.dims.main_first(lambda: prepare_data(data_cfg, cfg.model.vocab_size, data_dir, log=self.log,
                                                              seq_len=t.seq_len))
        self.tokenizer = self.data.tokenizer
        self.train_loader = open_loader(self.data, "train", seq_len=t.seq_len, micro_batch_size=t.micro_batch_size,
                                        dp_rank=self.dims.dp_rank, dp_world=cfg.parallel.dp, seed=t.seed,
                                        exhausted=cfg.data.exhausted, documents=cfg.data.documents)

        # meta → parallelize → materialize this rank's shards → initialize (a resume or model.init_from
        # then loads them in fit): no rank ever holds the whole model (parallel/materialize.py)
        parallel = parallelize(build_model(cfg.model, "meta"), self.dims, cfg, self.device)
        self.model, self.axes = parallel.model, parallel.axes
        self.optimizer = self.axes.wrap_optimizer(build_optimizer(self.model, cfg.optim))
        self.batch = BatchSchedule.from_config(cfg)  # tokens per step: fixed, or a ramp
        self.strategy = TrainStep(parallel, self.device, t.precision, t.z_loss, t.compile,
                                  count_loss_tokens=cfg.data.masked_targets, loss_chunk=t.loss_chunk)
        self.routers = RouterStats(self.model, self.axes)
        self.state = TrainState(self.train_loader, to_dict(cfg))
        # under LoRA a checkpoint holds the adapters (and their optimizer state); the frozen model is
        # model.init_from, which config.toml and lora.json name
        model_state = ModelState(self.model, self.optimizer, select=is_adapter if cfg.lora.rank > 0 else None)
        self.axes.track_state({"model": model_state, "train": self.state})
        self.validator = Validator(lambda: open_loader(self.data, "val", seq_len=t.seq_len,
                                                       micro_batch_size=t.micro_batch_size, seed=t.seed,
                                                       documents=cfg.data.documents),
                                   interval=cfg.eval.interval, batches=cfg.eval.batches,
                                   micro_batch_size=t.micro_batch_size, eval_loss=self.strategy.eval_loss,
                                   open_sources=lambda: source_loaders(self.data, "val", seq_len=t.seq_len,
                                                                       micro_batch_size=t.micro_batch_size,
                                                                       seed=t.seed, documents=cfg.data.documents))
        self.checkpoints = CheckpointPolicy(cfg, self.run_dir, self.dims.is_main, model_state, self.state,
                                            self.files, self.log)
        self.guard = StabilityGuard(cfg, self.checkpoints, self.train_loader, self.log)
        counts = count_params_of(cfg.model)
        self.n_params, self.n_active = counts.total, counts.active
        self.flops_per_token = flops_per_token_of(cfg.model, t.seq_len)
        self.mfu = MfuMeter(self.device, t.precision, self.flops_per_token, self.dims.world_size, self.log)
        self.periodic = PeriodicEvaluator(cfg, self.run_dir, self.log, enabled=not self.dims.distributed)
        self.profiler = StepProfiler(t.profile_steps, self.run_dir, self.dims.rank, self.device, self.log)
        if self.dims.is_main:
            (self.run_dir / "config.toml").write_text(to_toml(cfg), encoding="utf-8")

    @property
    def step(self) -> int:
        return self.state.step

    def files(self) -> dict[str, str]:
        """What makes a checkpoint self-contained besides its tensors."""
        files = {"config.toml": to_toml(self.cfg), **self.tokenizer.files()}
        if self.cfg.lora.rank > 0:
            files[LORA_FILE] = lora_reference(self.cfg)
        return files

    # ---- the loop ------------------------------------------------------------------------------
    def _record_start_memory(self) -> None:
        """The peaks of starting (built, loaded: no optimizer state exists yet), on record at once: a run
        killed later, out of memory at its first step, still shows what its start held."""
        self.start_memory = start_memory(self.device)
        write_memory_peak(self.run_dir, self.dims.rank, self.device, start=self.start_memory)

    def fit(self) -> TrainResult:
        t = self.cfg.training
        self.checkpoints.resume()
        self._record_start_memory()
        self.dims.barrier()  # every rank has resumed (and trimmed metrics) before rank 0 logs
        self._describe()
        first_val = val = self._validate(record_alone=True) if self.step == 0 else None
        total = self.total_steps()
        stop_at = total if t.stop_after <= 0 else min(total, self.step + t.stop_after)
        losses, sample = [], None
        self.log.start(self.step, stop_at)
        try:
            while self.step < stop_at:
                if (record := self.train_step()) is None:
                    continue  # not committed (a replica group failed mid-step): nothing changed, run it again
                if self.guard.after_step(record):
                    continue  # rolled back to an earlier checkpoint, past the data that caused a spike
                losses.append(record["loss"])
                if self.validator.due(self.step, at_end=self.step == total) and (new := self._validate()) is not None:
                    val = record["val_loss"] = new
                    record |= {f"val_loss/{name}": loss for name, loss in self.validator.per_source.items()}
                if (evaluating := self.periodic.evaluating) is not None:
                    # its child was started before this step and is alive after it: it ran throughout
                    record["eval_running"] = evaluating
                self.log.step(record)
                ckpt = self.checkpoints.after_step(self.step, stop_at)
                self.health.after_step(self.step)
                for result in self.periodic.after_step(self.step, self.model, self.files(), ckpt):
                    self.log.record(result)
            for result in self.periodic.finish(self.cfg.eval.final_wait, self.step, self.model, self.files(),
                                               self.checkpoints.last):
                self.log.record(result)
            sample = self.sample() if self.step == total and t.sample_tokens > 0 else None
            self._log_loss_tokens()
        finally:
            write_memory_peak(self.run_dir, self.dims.rank, self.device, start=self.start_memory)
            self.checkpoints.close()
            self.periodic.close()
            self.log.close()
        return self._result(losses, first_val, val, sample)

    def _result(self, losses: list[float], first_val: float | None, val: float | None, sample: str | None):
        return TrainResult(self.run_dir, self.step, losses[0] if losses else None, losses[-1] if losses else None,
                           first_val, val, sample, self.checkpoints.last, self.mfu.source,
                           self.state.loss_tokens if self.strategy.count_loss_tokens else None)

    def _log_loss_tokens(self) -> None:
        """A masked run's totals: the positions trained on and, of them, the tokens the loss counted."""
        if self.strategy.count_loss_tokens:
            self.log(f"trained {self.state.tokens:,} positions; {self.state.loss_tokens:,} of them counted in "
                     f"the loss ({self.state.loss_tokens / max(self.state.tokens, 1):.1%})")

    def total_steps(self) -> int:
        """Optimizer steps of the whole run: training.steps, or under a batch ramp as many as reach
        training.steps × batch_tokens tokens (from where the run stands)."""
        t = self.cfg.training
        return self.step + self.batch.steps_to(self.state.tokens, t.steps * t.batch_tokens) if self.batch.ramped \
            else t.steps

    def train_step(self) -> dict | None:
        """One optimizer step: forward/backward of the batch → global-norm clip → AdamW → a record.
        None when the axes did not commit it (nothing changed; the caller runs it again)."""
        self.profiler.before(self.step + 1)
        self.axes.begin_step(self.train_loader)
        cfg, start = self.cfg, time.perf_counter()
        seen, tokens = self.state.tokens, self.batch.tokens_at(self.state.tokens)
        # under a ramp the schedule follows tokens: the same LR at the same tokens, whatever the ramp
        lr = lr_at(seen / cfg.training.batch_tokens if self.batch.ramped else self.step, cfg.training.steps, cfg.optim)
        set_lr(self.optimizer, lr)
        n_micro_batches = tokens // self.batch.unit  # this step's, which a batch ramp varies
        self.routers.before_step(self.strategy.loss_weight(n_micro_batches))
        loss = self.strategy.forward_backward(self.train_loader.next_batch, n_micro_batches)
        max_norm = cfg.training.grad_clip if cfg.training.grad_clip > 0 else math.inf
        grad_norm = float(self.axes.clip_grad_norm(max_norm))
        skipped = self.guard.skip_update(self.step + 1, loss, grad_norm)  # NaN/Inf: no update
        if not skipped:
            self.checkpoints.before_update()  # an asynchronous save may still be copying the weights
            self.optimizer.step()
        self.axes.zero_grad(self.optimizer)
        moe = self.routers.after_step(n_micro_batches)
        if not self.axes.committed():
            return None
        axes = self.axes.step_metrics()
        for line in axes.pop("log", "").splitlines():  # e.g. a smaller quorum of replica groups
            self.log(line)
        self.state.step += 1
        self.state.tokens += tokens
        self.state.loss_tokens += self.strategy.loss_tokens
        elapsed = time.perf_counter() - start
        self.profiler.after(self.step)
        tokens_per_sec = tokens / elapsed
        mfu = self.mfu(tokens_per_sec)
        return {"step": self.step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
                "tokens": self.state.tokens, "tokens_per_sec": tokens_per_sec,
                "step_time": elapsed, "mfu": mfu, **self.train_loader.metrics(), **moe, **axes} | (
                    {"skipped": 1} if skipped else {}) | ({"batch_tokens": tokens} if self.batch.ramped else {}) | (
                    self._loss_token_metrics(tokens, elapsed, mfu) if self.strategy.count_loss_tokens else {})

    def _loss_token_metrics(self, tokens: int, elapsed: float, mfu: float) -> dict:
        """A masked run's tokens that counted in the loss (chat answers; all but each document's first
        target): this step's, all so far, per second, and the MFU they alone would give. `tokens`,
        `tokens_per_sec` and `mfu` count every position computed, the work the hardware did
        (docs/finetune.md)."""
        counted = self.strategy.loss_tokens
        return {"loss_tokens": counted, "loss_tokens_total": self.state.loss_tokens,
                "loss_tokens_per_sec": counted / elapsed, "loss_tokens_mfu": mfu * counted / tokens}

    def _validate(self, record_alone: bool = False) -> float | None:
        """The validation loss, logged (at step 0 also written as a metrics record of its own)."""
        val = self.validator.run() if self.validator.interval > 0 else None
        if val is not None:
            sources = self.validator.per_source
            each = " (" + ", ".join(f"{name} {loss:.4f}" for name, loss in sources.items()) + ")" if sources else ""
            self.log(f"step {self.step}: validation loss {val:.4f}{each}")
            if record_alone:
                self.log.record({"step": self.step, "val_loss": val,
                                 **{f"val_loss/{name}": loss for name, loss in sources.items()}})
        return val

    def _describe(self) -> None:
        cfg, t = self.cfg, self.cfg.training
        dp = f" × dp {cfg.parallel.dp}" if cfg.parallel.dp > 1 else ""
        active = f" ({self.n_active:,} active per token)" if self.n_active != self.n_params else ""
        self.log(f"model: {self.n_params:,} parameters{active}; {self.flops_per_token:.3g} training FLOPs/token; "
                 f"batch {t.batch_tokens:,} tokens = {cfg.grad_accum_steps} × {t.micro_batch_size} × {t.seq_len}{dp}; "
                 f"device {self.device}; precision {t.precision}")
        self.log(f"mfu: peak {self.mfu.peak / 1e12:.3g} TFLOP/s ({self.mfu.source})")
        if self.strategy.count_loss_tokens:
            self.log("loss mask: batch_tokens, tok/s and mfu count every position computed; the tokens the loss "
                     "counts are reported beside them (loss_tokens: this step, loss_tokens_total, loss_tokens_per_sec, "
                     "loss_tokens_mfu)")
        if cfg.lora.rank > 0:
            trainable, total = count_trainable(self.model)
            self.log(f"lora: rank {cfg.lora.rank} on {','.join(cfg.lora.targets)}: {trainable:,} of {total:,} "
                     f"parameters train ({trainable / total:.2%}); the rest are frozen, without optimizer state")
        if self.batch.ramped:
            self.log(f"batch ramp: {self.batch.start:,} → {t.batch_tokens:,} tokens a step over the first "
                     f"{self.batch.ramp_tokens:,} tokens; {self.total_steps():,} steps reach {t.steps} × "
                     f"{t.batch_tokens:,} tokens; the LR schedule follows tokens")
        if self.dims.restart_count:  # torchrun restarted the whole group after a failure
            self.log(f"launch: restart {self.dims.restart_count} of this job; resumed at step {self.step}")
            self.log.record({"step": self.step, "restarts": self.dims.restart_count})
        for line in self.axes.describe():
            self.log(line)

    @torch.no_grad()
    def sample(self, prompt: str = "def") -> str:
        """A short sample (every rank takes part under a parallel layout; rank 0 logs it)."""
        self.model.eval()
        ids = generate(self.strategy.sampling_model, self.tokenizer.encode(prompt), self.cfg.training.sample_tokens,
                       stop_id=self.tokenizer.eos_id, seed=self.cfg.training.seed,
                       length_multiple=self.axes.sequence_multiple)
        text = prompt + self.tokenizer.decode(ids)
        self.log("sample:\n" + text)
        return text


def train(cfg: Config, echo: bool = True) -> TrainResult:
    """Build a trainer and run it; after a run that ended normally, leave the process group it
    joined. After a failure the rank reports it, writes its flight record and destroys its groups
    without waiting on the others (`ParallelDims.fail`): a rank whose collective broke stops with
    one line naming the rank that failed."""
    trainer = Trainer(cfg, echo=echo)
    try:
        result = trainer.fit()
    except BaseException as err:
        trainer.axes.close()
        trainer.dims.fail(err, trainer.run_dir)  # reports, dumps, leaves; a broken collective names the rank
        raise
    trainer.axes.close()
    trainer.dims.leave()
    return result
