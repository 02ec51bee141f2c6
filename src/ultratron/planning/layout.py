"""The parallel layout of a training step, defined once.

`Layout` is the one definition of every layout field: its name, type, default, help, allowed
values and bounds. Everyone else takes it from here:

  config     `ParallelConfig` and `TrainingConfig` take their layout fields from these definitions
             (`fields.take_fields`; `PARALLEL_FIELDS` live in [parallel], `STEP_FIELDS` in
             [training]); `Config.layout` is the run's `Layout`, gradient accumulation derived from
             training.batch_tokens
  planner    `plan memory` / `plan estimate` price a `Layout`, `plan search` produces them
  plan       the command-line flags of `ultratron plan` are generated from these fields
  parallel   `ParallelDims.from_config(cfg.layout)` builds the device mesh from its degrees

Its rules — the fields' own bounds and choices, what the degrees need of each other and of the
model — are `check_layout`, which the config's validation and the planner both run. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from ultratron.fields import field_problems, option
from ultratron.planning.activations import RECOMPUTE
from ultratron.planning.pipeline import BALANCES, SCHEDULES, stages_per_rank
from ultratron.planning.rules import (
    Namer,
    data_parallel_wrapper,
    degree_problems,
    layout_problems,
    pipeline_fill_problem,
    pipeline_problems,
    short_name,
)

PRECISIONS = ("bf16", "fp32", "fp8")
ZERO3_UNITS = ("block", "linear")
FP8_SCALINGS = ("tensorwise", "rowwise")
# Where each layout field lives in the trainer's config; `grad_accum` lives in neither (the config
# derives it from training.batch_tokens), nor do the planner's own two fields (see `Layout`).
PARALLEL_FIELDS = ("dp", "dp_replicate", "zero", "tp", "sp", "pp", "pp_schedule", "pp_virtual_stages", "pp_split",
                   "pp_balance", "cp", "ep")
STEP_FIELDS = ("micro_batch_size", "seq_len", "precision", "fp8_scaling", "recompute", "compile", "loss_chunk",
               "offload_activations")


@dataclass(frozen=True)
class Layout:
    """How one training step is spread over GPUs: `grad_accum` micro-batches of `micro_batch_size`
    sequences of `seq_len` tokens per data-parallel rank.

    The defaults are the planner's (a bf16 run at scale); the trainer's config replaces those of
    the step fields with its own (a CPU demo). The last three fields are inputs of the planner only,
    which is why the config has none of them: `fp32_grad_accum` prices another framework's convention
    (the trainer has one: its own), and `attention_fp32` and `zero3_units` are how the trainer
    runs bf16 on a CPU and ZeRO-3 on a CPU's gloo, which it decides from the device, not from a
    setting."""

    dp: int = option(1, "data-parallel degree (under HSDP: dp_replicate × dp_shard)", minimum=1)
    dp_replicate: int = option(1, "HSDP: dp = dp_replicate × dp_shard; shard within groups, replicate across",
                               minimum=1)
    zero: int = option(0, "0 DDP, 1 ZeRO-1 (optimizer state), 2 ZeRO-2 (+ gradients), 3 ZeRO-3 (+ parameters)",
                       choices=(0, 1, 2, 3))
    tp: int = option(1, "tensor-parallel degree", minimum=1)
    sp: bool = option(False, "sequence parallel (needs tp > 1)")
    pp: int = option(1, "pipeline-parallel degree: the layers run as stages on pp ranks (docs/parallel.md)",
                     minimum=1)
    pp_schedule: str = option("1f1b", "pipeline schedule: gpipe (all forwards, then all backwards), 1f1b, "
                                      "interleaved-1f1b (several stages per rank), zb (interleaved zero "
                                      "bubble), zbv (zero bubble on a V), dualpipev", choices=SCHEDULES)
    pp_virtual_stages: int = option(0, "pipeline stages per rank; 0: the schedule's own (1 for gpipe and 1f1b, "
                                       "else 2); interleaved-1f1b and zb take any ≥ 2, zbv and dualpipev 2",
                                    minimum=0, flags=("--virtual-stages",))
    pp_split: str | None = option(None, "layers per pipeline stage in stage order, comma-separated (e.g. 3,5): "
                                        "pp × stages-per-rank entries adding up to the model's layers; default: "
                                        "balanced by pp_balance")
    pp_balance: str = option("flops", "what the default stage split evens out: flops (training FLOPs per token) "
                                      "or params; the embedding counts on the first stage, the head on the last",
                             choices=BALANCES)
    cp: int = option(1, "context-parallel degree: each sequence is cut into 2·cp chunks, two per rank (ring "
                        "attention with causal balance; docs/parallel.md)", minimum=1)
    ep: int = option(1, "expert-parallel degree: a mixture of experts' routed experts split over ep of the "
                        "data-parallel ranks (ep divides dp), tokens exchanged by all-to-all", minimum=1)
    micro_batch_size: int = option(1, "sequences per micro-batch per data-parallel rank", minimum=1,
                                   flags=("--mbs",))
    grad_accum: int = option(1, "micro-batches per data-parallel rank and optimizer step (the trainer derives it "
                                "from training.batch_tokens)", minimum=1, flags=("--grad-acc",))
    seq_len: int = option(4096, "tokens per sequence", minimum=1, flags=("--seq",))
    precision: str = option("bf16", "bf16: bf16 autocast compute, fp32 master weights; fp8: bf16 plus the blocks' "
                                    "linear layers in fp8 (torchao float8; docs/precision.md)", choices=PRECISIONS)
    fp8_scaling: str = option("tensorwise", "under precision fp8, the fp8 scales: tensorwise (one per tensor; under "
                                            "FSDP2 the weights are all-gathered in fp8) or rowwise (one per row, "
                                            "powers of two; FSDP2 gathers bf16); docs/precision.md",
                              choices=FP8_SCALINGS)
    recompute: str = option("none", "activation recomputation", choices=RECOMPUTE)
    compile: bool = option(False, "torch.compile each transformer block and the loss (after recompute, before "
                                  "FSDP/DDP; the trainer not yet with tp); the planner prices the fused kernels; "
                                  "docs/performance.md")
    loss_chunk: int = option(0, "tokens per chunk of the output head and its fp32 cross-entropy, computed chunk by "
                                "chunk so that the whole logits tensor never exists (forward or backward); 0 "
                                "computes them whole; `plan search` turns it on where the fastest layout that "
                                "fits uses it", minimum=0)
    offload_activations: bool = option(False, "the tensors the transformer blocks save for backward go to (pinned) "
                                              "host memory in forward and come back in backward; the planner prices "
                                              "the host memory and the PCIe traffic")
    fp32_grad_accum: bool = option(False, "price the Megatron-LM convention instead of the trainer's: bf16 "
                                          "weights, fp32 main gradients (no bf16 copy), fp32 master weights")
    # like Megatron's --attention-softmax-in-fp32; ultratron does this for bf16 on CPU
    # (models.llama.model.sdpa_attention)
    attention_fp32: bool = option(False, "attention computed in fp32 under bf16 (as ultratron does on a CPU)")
    # ultratron gathers per linear layer under gloo (parallel.data.prefetches_in_backward)
    zero3_units: str = option("block", "ZeRO-3's FSDP2 units: block (each transformer block one unit, the next "
                                       "gathered while a block runs backward: two blocks gathered at once, as on "
                                       "a GPU) or linear (each linear layer of a block of 64 MiB or more its own "
                                       "unit, nothing prefetched: one layer's weight gathered at a time, as "
                                       "ultratron runs on CPUs, where the collectives share the compute's cores; "
                                       "a smaller block one unit)",
                              choices=ZERO3_UNITS)

    @property
    def n_gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def gathered_bytes(self) -> int:
        """Bytes per parameter of the weights FSDP2 all-gathers: the compute dtype's, or under fp8 with
        tensorwise scales one (the blocks' matmul weights are gathered in fp8, `parallel/float8.py`;
        they are nearly all of a block's, its norms' few are priced at one byte too). Rowwise scales
        are computed on the whole weight, so FSDP2 gathers it in bf16 and it is cast after."""
        return 1 if self.precision == "fp8" and self.fp8_scaling == "tensorwise" else self.compute_bytes

    @property
    def stages_per_rank(self) -> int:
        return stages_per_rank(self.pp_schedule, self.pp_virtual_stages) if self.pp > 1 else 1

    @property
    def data_parallel(self) -> int:
        """The ranks a gradient is averaged over: dp × cp (cp ranks see other tokens of the sequences)."""
        return self.dp * self.cp

    @property
    def shard_group(self) -> int:
        """Ranks that ZeRO shards optimizer state, gradients and parameters over (HSDP: within a group)."""
        return self.dp // max(self.dp_replicate, 1) * self.cp

    @property
    def wrapper(self) -> str:
        """How the trainer runs data parallelism for this layout (`rules.data_parallel_wrapper`)."""
        return data_parallel_wrapper(self.data_parallel, self.zero, self.tp, self.pp, self.dp_replicate, self.ep)

    def describe(self) -> str:
        parts = [f"dp={self.dp}" + (f"(hsdp {self.dp_replicate}×{self.dp // self.dp_replicate})"
                                    if self.dp_replicate > 1 else "")]
        if self.zero:
            parts.append(f"zero={self.zero}")
        parts.append(f"tp={self.tp}{'+sp' if self.sp and self.tp > 1 else ''}")
        parts.append(f"pp={self.pp}")
        if self.pp > 1:
            v = self.stages_per_rank
            split = f"[{self.pp_split}]" if self.pp_split else ""
            parts.append(self.pp_schedule + (f"(v={v})" if v > 1 else "") + split)
        parts.append(f"cp={self.cp}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        parts += [f"mbs={self.micro_batch_size}", f"ga={self.grad_accum}", f"recompute={self.recompute}"]
        if self.precision == "fp8" and self.fp8_scaling != "tensorwise":
            parts.append(f"fp8 {self.fp8_scaling}")
        if self.compile:
            parts.append("compile")
        if self.offload_activations:
            parts.append("offload")
        if self.loss_chunk:
            parts.append(f"loss-chunk={self.loss_chunk}")
        return " ".join(parts)


def check_layout(shape, layout: Layout, name: Namer = short_name, *, fields: bool = True,
                 grad_accum_from: str | None = "", fill_pipeline: bool = True) -> list[str]:
    """Problems that make a layout impossible for a shape, one line each (empty when fine): each
    field's bounds and choices (`fields`; the config checks those with its other fields), then the
    rules of `planning/rules.py`. `name` turns `section.field` into what the user wrote (the
    planner: the bare field name). `grad_accum_from` says where the micro-batch count comes from,
    for the pipeline's message (default: the field itself; None: not known, the config's batch
    does not divide into micro-batches). `fill_pipeline=False` lets a pipeline have fewer
    micro-batches than it needs to fill (`underfilled_pipeline` says so)."""
    if fields:
        p = field_problems(layout, lambda field: name(f"{section_of(field)}.{field}"))
        if p:
            return p
    p = degree_problems(layout, name)
    p += layout_problems(shape, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, seq=layout.seq_len,
                         dp=layout.dp, dp_replicate=layout.dp_replicate, name=name)
    p += pipeline_problems(shape, pp=layout.pp, schedule=layout.pp_schedule, virtual_stages=layout.pp_virtual_stages,
                           split=layout.pp_split,
                           micro_batches=None if grad_accum_from is None else layout.grad_accum,
                           micro_batches_from=grad_accum_from or name("training.grad_accum"),
                           dp=layout.data_parallel, zero=layout.zero, recompute=layout.recompute, name=name,
                           fill=fill_pipeline)
    return p


def underfilled_pipeline(layout: Layout) -> str | None:
    """The line `check_layout` gives a pipeline whose micro-batches per step cannot fill it, else None."""
    return pipeline_fill_problem(pp=layout.pp, schedule=layout.pp_schedule, virtual_stages=layout.pp_virtual_stages,
                                 micro_batches=layout.grad_accum, micro_batches_from=short_name("training.grad_accum"),
                                 name=short_name)


def section_of(field: str) -> str:
    """The trainer's config section a layout field lives in (`grad_accum` and the planner's own
    fields: "training", where the trainer's step settings are)."""
    return "parallel" if field in PARALLEL_FIELDS else "training"
