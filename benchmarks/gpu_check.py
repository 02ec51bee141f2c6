"""The prepared GPU check: what a person with one GPU runs once, and sends back.

  python benchmarks/gpu_check.py [--tiny] [--gpu h100-sxm] [--limit SECONDS] [--only ROW,ROW]
  make gpu-check

Each row is a figure measured on this device beside the planner's prediction for the same work
(`planning.search.estimate_step`, what `plan estimate` prints; `planning.compute.matmul_seconds` for
products alone), from the hardware table (`planning/hardware.py`) on a GPU and from this machine's
measured matmul and memory rates on a CPU:

  matmul-bf16, matmul-fp8   the products of the 1B's and the 8B's layers and heads at 8,192 tokens
                            (`planning.compute.layer_matmuls`), timed alone in bf16 and in fp8 as
                            torchao's tensorwise kernel runs them (`benchmarks/matmul_shapes.py`);
                            each shape's rate follows the table. fp8's is the rate `plan estimate
                            --precision fp8` assumes (twice bf16's peak) and no one has measured
  eager, compiled           tokens/s and MFU of a Llama-3 1B training step (llama3-1b, bf16, seq 2,048,
                            4 sequences), eager and with `training.compile`
  fp8                       tokens/s of the compiled step under `training.precision fp8` ÷ bf16's
  flex-vs-sdpa              with `data.document_masking` (documents of 1/8 to 3/8 of a row): the step
                            under `model.attention sdpa` ÷ under `flex` (on a CPU, which has no flex
                            backward, the forward); the planner prices attention alike for both
  loss-chunk, offload       peak memory and step time with `training.loss_chunk` and with
                            `training.offload_activations` (eager)
  health                    `ultratron health`'s check: NVML's verdict and its timing matmul

The training rows run the trainer's own pieces in this process (`parallelize`, `TrainStep`, the axes'
clipping, AdamW), on random tokens. It exits 0 when every row has its measured and its planned
figure, 1 when one is missing (the row says why), 2 when the time limit stops it (the rows measured
so far are printed). Without a CUDA device, or with --tiny, it runs the same rows on the tiny preset
(2 layers, seq 128, 2 sequences).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

# the time limits --help states and the watchdog enforces (the tiny size takes under 2 minutes on two idle
# cores; its limit leaves room for a busy machine and Inductor's first compile)
GPU_LIMIT_S, TINY_LIMIT_S = 480, 300
GiB = 2**30
EXIT_MISSING, EXIT_TIME = 1, 2


@dataclass(frozen=True)
class Size:
    """What the check runs at: the 1B on a GPU, the tiny preset on a CPU."""

    preset: str
    layers: int  # of the preset's (a tiny step: fewer)
    seq: int
    micro_batch: int
    steps: int  # timed, after `warmup`
    warmup: int
    loss_chunk: int
    health_matmul: int
    also_products_of: tuple[str, ...] = ()  # presets whose layers' products the matmul rows also time


FULL = Size("llama3-1b", 16, 2048, 4, 4, 2, 1024, 4096, ("llama3-8b",))
TINY = Size("tiny", 2, 128, 2, 2, 1, 64, 256)
# cheap rows first, the ones that compile last: a run the watchdog stops has the most rows printed
ROWS = ("health", "matmul-bf16", "matmul-fp8", "eager", "loss-chunk", "offload", "flex-vs-sdpa", "compiled", "fp8")


class Missing(Exception):
    """A figure that could not be had, and why."""


@dataclass
class Row:
    name: str
    what: str
    measured: str = ""
    planned: str = ""
    ratio: str = ""
    missing: str = ""
    seconds: float = 0.0  # what the row took, compiling and warm-up included


def _load_benchmark(name: str):
    """A sibling benchmark script as a module (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location(f"ultratron_bench_{name}", Path(__file__).parent / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ratio(measured: float, planned: float) -> str:
    return f"{measured / planned:.2f}" if planned else ""


class Check:
    """The device, its planner accelerator, and one measurement per row."""

    def __init__(self, size: Size, device: torch.device, gpu: str | None):
        from ultratron.training.precision import configure_matmuls

        self.size, self.device = size, device
        configure_matmuls(device)  # TF32 for fp32 matmuls on a GPU, as the trainer sets it
        self.acc = self._accelerator(gpu)
        self.results: dict[str, dict] = {}  # training measurements, by row, for the rows that compare two

    # ---- the planner's side -------------------------------------------------------------------
    def _accelerator(self, gpu: str | None):
        """The hardware table's entry for this GPU (or --gpu); on a CPU one made of its measured rates."""
        from ultratron.planning.hardware import Accelerator, find_accelerator

        if self.device.type == "cuda":
            self.gpu = gpu or torch.cuda.get_device_name(self.device)
            return find_accelerator(self.gpu)  # None: every planned figure says why it is missing
        from ultratron.bench.comm import memory_rate
        from ultratron.bench.report import CPU_LINK_BYTES_PER_S
        from ultratron.training.mfu import device_peak_flops

        flops = {p: device_peak_flops(self.device, p)[0] for p in ("fp32", "bf16", "fp8")}
        bandwidth = memory_rate(self.device, torch.float32, 64 * 2**20, 5)
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return Accelerator("this CPU (its measured matmul and memory rates)", flops, memory, CPU_LINK_BYTES_PER_S,
                           CPU_LINK_BYTES_PER_S, 1, "measured here", memory_bw=bandwidth, memory_achieved=1.0,
                           attention_table=False)

    def _need_acc(self):
        if self.acc is None:
            raise Missing(f"planned: {self.gpu!r} is not in the hardware table "
                          "(planning/hardware.py); give --gpu with a table entry")
        return self.acc

    def plan(self, cfg):
        """`plan estimate` for this config on one device."""
        from ultratron.planning.search import SearchSpec, estimate_step

        acc, t = self._need_acc(), cfg.training
        layout = replace(cfg.layout, attention_fp32=self.device.type == "cpu" and t.precision != "fp32")
        if t.precision not in acc.flops:
            raise Missing(f"planned: no {t.precision} peak for {acc.name} in the hardware table")
        return estimate_step(SearchSpec(cfg.model, acc, 1, 1, t.batch_tokens, t.seq_len, t.precision), layout)

    # ---- the measured side --------------------------------------------------------------------
    def config(self, **fields):
        """The check's training config, with `fields` ({"training.compile": "true", ...}) on top."""
        from ultratron.config import load_config

        s = self.size
        flags = ["--model.preset", s.preset, "--model.n_layers", str(s.layers), "--model.max_seq_len", str(s.seq),
                 "--training.seq_len", str(s.seq), "--training.micro_batch_size", str(s.micro_batch),
                 "--training.batch_tokens", str(s.seq * s.micro_batch), "--training.precision", "bf16",
                 "--training.device", self.device.type]
        for key, value in fields.items():
            flags += [f"--{key}", str(value)]
        return load_config(None, flags)

    def batch(self, cfg, documents: bool):
        """Random tokens (and document numbers: documents of 1/8, 3/8, 1/4 and 1/4 of the row)."""
        s, vocab = self.size, cfg.model.vocab_size
        g = torch.Generator().manual_seed(0)
        inputs, targets = (torch.randint(0, vocab, (s.micro_batch, s.seq), generator=g) for _ in "it")
        if not documents:
            return inputs, targets
        eighth = s.seq // 8
        starts = torch.zeros(s.seq, dtype=torch.long)
        starts[[eighth, 4 * eighth, 6 * eighth]] = 1
        return inputs, targets, starts.cumsum(0).expand(s.micro_batch, -1).contiguous()

    def train(self, cfg, forward_only: bool = False) -> dict:
        """The trainer's step on this config: step seconds (median of the timed steps), tokens/s, MFU
        (the trainer's meter) and peak bytes (a GPU's allocator peak; on a CPU the parameters, gradients
        and optimizer state plus a step's allocations, `parallel.memory.AllocatedBytes`)."""
        from ultratron.bench.timing import seconds_of
        from ultratron.models.registry import build_model
        from ultratron.parallel.memory import AllocatedBytes, measured_bytes
        from ultratron.parallel.parallelize import parallelize, topology
        from ultratron.planning.flops import flops_per_token_of
        from ultratron.training.mfu import MfuMeter
        from ultratron.training.optim import build_optimizer
        from ultratron.training.step import TrainStep

        t, s = cfg.training, self.size
        torch.manual_seed(t.seed)
        parallel = parallelize(build_model(cfg.model, "meta"), topology(cfg.layout), cfg, self.device)
        optimizer = parallel.axes.wrap_optimizer(build_optimizer(parallel.model, cfg.optim))
        step = TrainStep(parallel, self.device, t.precision, t.z_loss, t.compile, loss_chunk=t.loss_chunk)
        batch = self.batch(cfg, cfg.data.documents)

        def one() -> None:
            if forward_only:  # validation's forward and loss, no gradients
                step.eval_loss(*batch)
                return
            step.forward_backward(lambda: batch, 1)
            parallel.axes.clip_grad_norm(t.grad_clip if t.grad_clip > 0 else math.inf)
            optimizer.step()
            parallel.axes.zero_grad(optimizer)

        for _ in range(s.warmup):
            one()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        seconds = statistics.median(seconds_of(one, self.device) for _ in range(s.steps))
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            for p in parallel.model.parameters():  # the gradients exist before the measured stretch
                p.grad = torch.zeros_like(p) if p.requires_grad and not forward_only else None
            static = sum(measured_bytes(parallel.model, optimizer).values())
            with AllocatedBytes() as meter:
                step.forward_backward(lambda: batch, 1) if not forward_only else step.eval_loss(*batch)
            peak = static + meter.peak
        tokens_per_s = s.seq * s.micro_batch / seconds
        meter = MfuMeter(self.device, t.precision, flops_per_token_of(cfg.model, t.seq_len), 1, log=lambda _: None)
        return {"seconds": seconds, "tokens_per_s": tokens_per_s, "mfu": meter(tokens_per_s), "peak": peak}

    def measured(self, name: str, fields: dict | None = None, forward_only: bool = False) -> dict:
        """A training measurement, once per row name (fp8 compares with the compiled one)."""
        if name not in self.results:
            self.results[name] = self.train(self.config(**(fields or {})), forward_only)
            if (fields or {}).get("training.compile") == "true":
                torch._dynamo.reset()  # its compiled blocks, which the next row does not run
            gc.collect()  # the row's model and optimizer state go before the next row's
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return self.results[name]


def _rate(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e12:.1f} TFLOP/s" if flops_per_s >= 1e12 else f"{flops_per_s / 1e9:.1f} GFLOP/s"


def _throughput(tokens_per_s: float, mfu: float) -> str:
    return f"{tokens_per_s:,.0f} tok/s, MFU {mfu:.1%}"


def _memory_and_time(peak: float, seconds: float) -> str:
    return f"peak {peak / GiB:.2f} GiB, step {seconds:.3f} s"


# ---- the rows ------------------------------------------------------------------------------------
def matmul_row(check: Check, dtype: str) -> Row:
    """The model's products (each layer's, and the head), timed alone; planned by the planner's matmul
    time at the table's peak for the dtype (its in-model efficiency, `planning.compute`)."""
    from ultratron.bench.timing import seconds_of
    from ultratron.models.presets import PRESETS
    from ultratron.planning.compute import layer_matmuls, matmul_seconds
    from ultratron.planning.layout import Layout

    names = (check.size.preset, *check.size.also_products_of)
    row = Row(f"matmul-{dtype}", f"{dtype} products of {' and '.join(names)}'s layers and head, alone")
    tokens = check.size.seq * check.size.micro_batch
    products = []
    for shape in (check.config().model, *(PRESETS[name] for name in check.size.also_products_of)):
        products += [(m, k, n, count * shape.n_layers) for m, k, n, count in layer_matmuls(shape, tokens, 1)]
        products.append((tokens, shape.dim, shape.vocab_size, 1))  # the head
    product = _load_benchmark("matmul_shapes").product
    flops = seconds = 0.0
    by_shape = {}
    for m, k, n, count in products:
        key = int(m), int(k), int(n)
        if key not in by_shape:  # (wq and wo, for one, are the same product)
            run = product(check.device.type, "fp8" if dtype == "fp8" else torch.bfloat16, *key)
            run()  # warm-up
            by_shape[key] = 2 * m * k * n / statistics.median(seconds_of(run, check.device) for _ in range(5))
        seconds += count * 2 * m * k * n / by_shape[key]
        flops += count * 2 * m * k * n
    row.measured = _rate(flops / seconds)
    check.results[row.name] = by_shape  # (printed under the table, shape by shape)
    acc = check._need_acc()
    if dtype not in acc.flops:
        raise Missing(f"planned: no {dtype} peak for {acc.name} in the hardware table (measured {row.measured})")
    p = Layout(precision=dtype).compute_bytes  # the bytes an element the planner prices the products at
    planned = sum(count * matmul_seconds(m, k, n, acc.flops[dtype], acc.hbm_bw, p) for m, k, n, count in products)
    row.planned, row.ratio = _rate(flops / planned), _ratio(planned, seconds)
    return row


def training_row(check: Check, name: str, what: str, fields: dict) -> Row:
    row = Row(name, what)
    cfg = check.config(**fields)
    m = check.measured(name, fields)
    row.measured = _throughput(m["tokens_per_s"], m["mfu"]) + f"; peak {m['peak'] / GiB:.2f} GiB"
    est = check.plan(cfg)
    row.planned = _throughput(est.tokens_per_s_per_gpu, est.mfu) + f"; peak {est.memory.peak_bytes / GiB:.2f} GiB"
    row.ratio = _ratio(m["tokens_per_s"], est.tokens_per_s_per_gpu)
    return row


def fp8_row(check: Check) -> Row:
    """fp8 over bf16, both compiled on a GPU (as fp8 runs at speed), both eager on a CPU (emulated)."""
    compiled = {"training.compile": str(check.device.type == "cuda").lower()}
    name = "compiled" if check.device.type == "cuda" else "eager"
    row = Row("fp8", f"tokens/s of fp8 ÷ bf16 ({name}{', emulated' if check.device.type != 'cuda' else ''})")
    fp8 = {**compiled, "training.precision": "fp8"}
    ratio = check.measured("fp8", fp8)["tokens_per_s"] / check.measured(name, compiled)["tokens_per_s"]
    row.measured = f"{ratio:.2f}×"
    planned = check.plan(check.config(**fp8)).tokens_per_s_per_gpu / check.plan(
        check.config(**compiled)).tokens_per_s_per_gpu
    row.planned, row.ratio = f"{planned:.2f}×", _ratio(ratio, planned)
    return row


def flex_row(check: Check) -> Row:
    """Step time under sdpa ÷ under flex, with document masks (on a CPU the forward: no flex backward)."""
    from ultratron.errors import ConfigError

    forward = check.device.type != "cuda"
    row = Row("flex-vs-sdpa", "document masks: sdpa time ÷ flex time" + (" (forward)" if forward else " (step)"))
    times = {}
    for backend in ("sdpa", "flex"):
        fields = {"data.document_masking": "on", "model.attention": backend}
        try:
            times[backend] = check.measured(f"{backend}-documents", fields, forward_only=forward)["seconds"]
        except ConfigError as err:
            if any("attention" in p for p in err.problems):
                raise Missing("model.attention not available: " + "; ".join(err.problems)) from err
            raise
    row.measured = f"{times['sdpa'] / times['flex']:.2f}× (flex {times['flex']:.3f} s, sdpa {times['sdpa']:.3f} s)"
    est = {b: check.plan(check.config(**{"data.document_masking": "on", "model.attention": b})).step_s
           for b in ("sdpa", "flex")}
    planned = est["sdpa"] / est["flex"]
    row.planned = f"{planned:.2f}× (attention priced alike for both)"
    row.ratio = _ratio(times["sdpa"] / times["flex"], planned)
    return row


def memory_row(check: Check, name: str, what: str, fields: dict) -> Row:
    """Peak memory and step time against the eager step's, each beside the planner's."""
    row = Row(name, what)
    base, m = check.measured("eager", {}), check.measured(name, fields)
    row.measured = _memory_and_time(m["peak"], m["seconds"]) + f" (whole step: {base['peak'] / GiB:.2f} GiB)"
    est, whole = check.plan(check.config(**fields)), check.plan(check.config())
    row.planned = _memory_and_time(est.memory.peak_bytes, est.step_s) + \
        f" (whole step: {whole.memory.peak_bytes / GiB:.2f} GiB)"
    row.ratio = _ratio(m["peak"], est.memory.peak_bytes)
    return row


def health_row(check: Check) -> Row:
    """`ultratron health`'s check on this device; its matmul against the planner's time for it."""
    from ultratron.planning.compute import matmul_seconds
    from ultratron.training.health import GpuMonitor, check_rank

    size = check.size.health_matmul
    monitor = GpuMonitor(cuda_device=check.device.index or 0) if check.device.type == "cuda" else GpuMonitor()
    report = check_rank(0, check.device, monitor, matmul_size=size, max_temperature=90, distributed=False)
    row = Row("health", f"NVML and a {size}² matmul")
    if report.gpu.problems:
        raise Missing("health check FAILED: " + "; ".join(report.gpu.problems))
    row.measured = f"{report.gpu.summary}; matmul {report.matmul_s * 1e3:.2f} ms"
    acc, dtype = check._need_acc(), "bf16" if check.device.type == "cuda" else "fp32"  # (health's matmul dtype)
    planned = matmul_seconds(size, size, size, acc.flops[dtype], acc.hbm_bw, 2 if dtype == "bf16" else 4)
    row.planned, row.ratio = f"matmul {planned * 1e3:.2f} ms", _ratio(report.matmul_s, planned)
    return row


RUN = {
    "matmul-bf16": lambda c: matmul_row(c, "bf16"),
    "matmul-fp8": lambda c: matmul_row(c, "fp8"),
    "eager": lambda c: training_row(c, "eager", "bf16 training step, eager", {}),
    "compiled": lambda c: training_row(c, "compiled", "bf16 training step, training.compile",
                                       {"training.compile": "true"}),
    "fp8": fp8_row,
    "flex-vs-sdpa": flex_row,
    "loss-chunk": lambda c: memory_row(c, "loss-chunk", f"training.loss_chunk {c.size.loss_chunk}",
                                       {"training.loss_chunk": c.size.loss_chunk}),
    "offload": lambda c: memory_row(c, "offload", "training.offload_activations (eager)",
                                    {"training.offload_activations": "true"}),
    "health": health_row,
}


# ---- the table -----------------------------------------------------------------------------------
def print_row(row: Row) -> None:
    measured = f"missing: {row.missing}" if row.missing else row.measured
    print(f"| {row.name} | {row.what} | {measured} | {row.planned or '—'} | {row.ratio or '—'} | {row.seconds:.0f} |",
          flush=True)


def run_rows(check: Check, names: list[str], done: list[Row]) -> None:
    print("| row | what | measured | planned | measured ÷ planned | s |\n|---|---|---|---|---|---|", flush=True)
    for name in names:
        start = time.perf_counter()
        try:
            row = RUN[name](check)
        except Missing as err:
            row = Row(name, "", missing=str(err))
        except Exception as err:  # any failure is a missing figure, said in the row
            lines = str(err).strip().splitlines() or [""]
            row = Row(name, "", missing=f"{type(err).__name__}: {lines[0][:300]}")
        if not row.missing and not (row.measured and row.planned):
            row.missing = "no planned figure" if row.measured else "no measured figure"
        row.seconds = time.perf_counter() - start
        done.append(row)
        print_row(row)


def print_shapes(check: Check) -> None:
    """The products' rates one by one (M tokens × K in × N out), fp8's beside bf16's: #29's missing figure."""
    bf16, fp8 = check.results.get("matmul-bf16", {}), check.results.get("matmul-fp8", {})
    for shape in bf16 or fp8:
        rates = [f"{dtype} {_rate(rates[shape])}" for dtype, rates in (("bf16", bf16), ("fp8", fp8)) if shape in rates]
        both = f" (fp8 ÷ bf16 {fp8[shape] / bf16[shape]:.2f})" if shape in bf16 and shape in fp8 else ""
        print(f"matmul {' × '.join(map(str, shape))}: {', '.join(rates)}{both}")


def _watchdog(limit: float, names: list[str], done: list[Row]) -> threading.Timer:
    def expire() -> None:
        left = [n for n in names if n not in {r.name for r in done}]
        print(f"gpu_check: the time limit of {limit:.0f} s was reached; not measured: {', '.join(left)}",
              flush=True)
        os._exit(EXIT_TIME)

    timer = threading.Timer(limit, expire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Time limit: {GPU_LIMIT_S // 60} minutes on a GPU, {TINY_LIMIT_S // 60} at the tiny size, enforced "
               f"by a watchdog (exit {EXIT_TIME}). Rows: {', '.join(ROWS)}.")
    parser.add_argument("--tiny", action="store_true", help="the tiny size (the default without a CUDA device)")
    parser.add_argument("--gpu", help="the hardware table's entry to plan with (default: the device's name)")
    parser.add_argument("--limit", type=float, help="seconds before the watchdog stops the check (default: "
                                                    f"{GPU_LIMIT_S} on a GPU, {TINY_LIMIT_S} tiny)")
    parser.add_argument("--only", help="comma-separated rows to run (default: all)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(ROWS)
    unknown = [n for n in names if n not in RUN]
    if unknown:
        parser.error(f"unknown rows {', '.join(unknown)}; rows: {', '.join(ROWS)}")
    cuda = torch.cuda.is_available()
    size = TINY if args.tiny or not cuda else FULL
    limit = args.limit or (GPU_LIMIT_S if size is FULL else TINY_LIMIT_S)
    done: list[Row] = []
    timer = _watchdog(limit, names, done)
    start = time.perf_counter()
    try:
        check = Check(size, torch.device("cuda" if cuda else "cpu"), args.gpu)
        where = torch.cuda.get_device_name() if cuda else "CPU"
        planner = check.acc.name if check.acc is not None else "none (not in the hardware table)"
        print(f"gpu_check: {where}, torch {torch.__version__}; {size.preset} at seq {size.seq} × {size.micro_batch}, "
              f"bf16; planned for {planner}; limit {limit:.0f} s", flush=True)
        run_rows(check, names, done)
        print_shapes(check)
    finally:
        timer.cancel()
    missing = [r for r in done if r.missing]
    print(f"gpu_check: {len(done) - len(missing)} of {len(done)} rows measured and planned in "
          f"{time.perf_counter() - start:.0f} s" + (f"; missing: {', '.join(r.name for r in missing)}" if missing
                                                    else ""), flush=True)
    return EXIT_MISSING if missing else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    sys.exit(main())
