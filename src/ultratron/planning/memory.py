"""Bytes per GPU of a training step for a model shape and a parallel layout.

Static terms (per parameter, Ultra-Scale Playbook / Rajbhandari et al. 2020, ZeRO):
  bf16 mixed precision: bf16 params 2 + bf16 grads 2 + fp32 master 4 + Adam moments 8 = 16 bytes,
  plus 4 for an fp32 gradient-accumulation buffer (`fp32_grad_accum`); fp32: 4 + 4 + 0 + 8 = 16.
  (The trainer's autocast flavour of bf16 keeps fp32 params and grads, 4 + 4 + 8 = 16 as well,
  plus a transient bf16 copy of the weights that autocast caches during forward.)
  ZeRO-1 shards master + moments, ZeRO-2 also grads, ZeRO-3 also params, over dp·cp ranks (the
  group FSDP / the distributed optimizer shards over when context parallel is on). TP shards the
  matrices (norm weights stay whole), PP keeps ceil(L/pp) layers per stage; the first stage adds
  the embedding, the last the final norm and output head (also the embedding's copy when tied).

Activations (saved for backward, per layer and micro-batch), two estimators:
  * "textbook" — Korthikanti et al. 2022 (arXiv 2205.05198), bf16, multi-head attention, 4h MLP:
    s·b·h·(34 + 5·a·s/h); TP without SP s·b·h·(10 + 24/t + 5·a·s/(h·t)); TP + SP s·b·h·(34 + 5·a·s/h)/t;
    selective recompute drops the 5·a·s/h term, full recompute keeps 2·s·b·h (÷t with SP).
  * "per-op" — counts what `ultratron.models.llama` actually saves, tensor by tensor (T = tokens of
    the micro-batch on this rank, p = 2 bytes in bf16 or 4 in fp32, f = ffn_dim, kv = n_kv·head_dim):
      RMSNorm (×2): fp32 input 4·T·h + fp32 normalised 4·T·h + output p·T·h (saved by the next
      matmuls) + fp32 rsqrt 4·T (+ an fp32 copy of the weight in bf16);
      attention: q and k after RoPE, v, and the attention output, p·T·(2h + 2kv) (4·T·(2h + 2kv)
      with `attention_fp32`); flash attention
      keeps no s×s scores, only the fp32 log-sum-exp 4·b·a·s; the GQA kv heads are counted at
      their own width, not repeated to n_heads;
      SwiGLU: w1·x, w3·x, silu(w1·x) and their product, 4·p·T·f.
    Selective recompute (ultratron's definition) recomputes the RMSNorms and SwiGLU's silu·mul in
    backward, so a norm keeps its input and output 2·p·T·h and the MLP 3·p·T·f. Full recompute
    keeps each layer's input p·T·h and recomputes one layer at a time during backward.
    TP divides everything between the column- and row-parallel matmuls by t; sequence parallel
    divides the norm regions too (its gathered input is re-gathered in backward, as in Korthikanti).
  Both: CP divides tokens by cp; the loss keeps fp32 log-probabilities 4·T·v/t (vocab-parallel)
  and the int64 targets 8·T.

Mixture of experts (`planning.experts`): the routed experts split over ep·tp and left out of ZeRO's
sharding, as the trainer does; the routed slots' activations in place of the dense SwiGLU's (per-op
model); the all-to-all's send and receive buffers under expert parallelism.

Pipeline parallel: the stages, their layers and their ranks come from `planning.pipeline` — the
same split and placement the trainer runs. A rank holds the parameters of its stages (the embedding
with the first, the final norm and a head — its own copy when tied — with the last). Its schedule
keeps several micro-batches' activations alive at once: the planner walks the order the schedule
runs (`planning.pipeline.schedule_events`, checked against torch's) and takes the moment the
rank's activations peak (GPipe: all m; 1F1B: pp − rank; interleaved and zero bubble: their warm-up
depth; the V schedules about 2·pp stage-chunks). torch's stages also keep a receive buffer per
micro-batch for the activations (and for their gradients) of each stage that has a neighbour on
another rank. Every pipeline rank is estimated; the heaviest is reported
(`estimate_memory_per_rank` gives each).

Peak = static + communication buffers + the larger of (activations + the transient loss logits +
one recomputed layer) and (the optimizer step's temporaries: torch's foreach AdamW allocates an
fp32 tensor per parameter shard for sqrt(v)).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ultratron.errors import UserError
from ultratron.planning.experts import all_to_all_buffer_bytes, extra_activation_bytes, routed_expert_params_per_layer
from ultratron.planning.params import count_params_of
from ultratron.planning.pipeline import (
    BALANCES,
    SCHEDULES,
    peak_in_flight,
    rank_stages,
    stage_ranks,
    stage_split,
    stages_per_rank,
)
from ultratron.planning.rules import head_dim_of, layout_problems, pipeline_problems, short_name

GiB = 1024**3
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp32")
ACTIVATION_MODELS = ("per-op", "textbook")
DDP_BUCKET_BYTES = 25 * 1024**2  # torch DDP's default bucket_cap_mb


@dataclass(frozen=True)
class Layout:
    """How one training step is spread over GPUs. `grad_acc` micro-batches of `mbs` sequences per dp rank."""

    dp: int = 1
    zero: int = 0
    tp: int = 1
    sp: bool = False
    pp: int = 1
    pp_schedule: str = "1f1b"
    virtual_stages: int = 0  # stages per pipeline rank; 0: the schedule's own (planning.pipeline)
    pp_split: str | None = None  # layers per stage, as parallel.pp_split; None: balanced by pp_balance
    pp_balance: str = "flops"
    cp: int = 1
    ep: int = 1
    mbs: int = 1
    grad_acc: int = 1
    seq: int = 4096
    recompute: str = "none"
    precision: str = "bf16"
    fp32_grad_accum: bool = False
    # Attention (q, k, v, output) computed in fp32 even in bf16, like Megatron's
    # --attention-softmax-in-fp32; ultratron does this for bf16 on CPU (models.llama.model.sdpa_attention).
    attention_fp32: bool = False

    @property
    def n_gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def compute_bytes(self) -> int:
        return 2 if self.precision == "bf16" else 4

    @property
    def stages_per_rank(self) -> int:
        return stages_per_rank(self.pp_schedule, self.virtual_stages) if self.pp > 1 else 1

    @property
    def shard_group(self) -> int:
        """Ranks that ZeRO shards optimizer state, gradients and parameters over."""
        return self.dp * self.cp

    def describe(self) -> str:
        parts = [f"dp={self.dp}"]
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
        parts += [f"mbs={self.mbs}", f"ga={self.grad_acc}", f"recompute={self.recompute}"]
        return " ".join(parts)


@dataclass
class MemoryBreakdown:
    """Bytes on the heaviest GPU (the first or last pipeline stage), term by term."""

    parameters: float
    gradients: float
    grad_accum_buffer: float
    master_weights: float
    optimizer_states: float
    activations: float
    loss_logits: float  # the fp32 log-probabilities kept for the cross-entropy backward
    comm_buffers: float
    transient: float  # what is briefly alive at the peak on top of the above (see the module doc)
    stage: str  # "only", or the pipeline rank's stages: "first", "last", "first+last" or "middle"
    extra: dict = field(default_factory=dict)

    TERMS = ("parameters", "gradients", "grad_accum_buffer", "master_weights", "optimizer_states",
             "activations", "loss_logits", "comm_buffers", "transient")

    @property
    def static_bytes(self) -> float:
        return (self.parameters + self.gradients + self.grad_accum_buffer + self.master_weights
                + self.optimizer_states)

    @property
    def peak_bytes(self) -> float:
        return sum(getattr(self, term) for term in self.TERMS)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["static_bytes"] = self.static_bytes
        out["peak_bytes"] = self.peak_bytes
        return out


def _flag_name(field: str) -> str:
    """A config field's name as the planner's layout says it (parallel.pp_virtual_stages → virtual_stages)."""
    short = short_name(field)
    return {"pp_virtual_stages": "virtual_stages"}.get(short, short)


def check_layout(shape, layout: Layout) -> list[str]:
    """Problems that make a layout impossible for a shape, one line each (empty when fine)."""
    p: list[str] = []
    for name in ("dp", "tp", "pp", "cp", "ep", "mbs", "grad_acc", "seq"):
        if getattr(layout, name) < 1:
            p.append(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(layout, name)}")
    if layout.virtual_stages < 0:
        p.append(f"--virtual-stages must be ≥ 0 (0: the schedule's own), got {layout.virtual_stages}")
    if p:
        return p
    if layout.zero not in (0, 1, 2, 3):
        p.append(f"--zero must be 0, 1, 2 or 3, got {layout.zero}")
    if layout.pp_schedule not in SCHEDULES:
        p.append(f"--pp-schedule {layout.pp_schedule!r} is not one of {', '.join(SCHEDULES)}")
    if layout.pp_balance not in BALANCES:
        p.append(f"--pp-balance {layout.pp_balance!r} is not one of {', '.join(BALANCES)}")
    if layout.recompute not in RECOMPUTE:
        p.append(f"--recompute {layout.recompute!r} is not one of {', '.join(RECOMPUTE)}")
    if layout.precision not in PRECISIONS:
        p.append(f"--precision {layout.precision!r} is not one of {', '.join(PRECISIONS)}")
    p += layout_problems(shape, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, seq=layout.seq, dp=layout.dp,
                         name=short_name)
    if not p:
        p += pipeline_problems(shape, pp=layout.pp, schedule=layout.pp_schedule, virtual_stages=layout.virtual_stages,
                               split=layout.pp_split, micro_batches=layout.grad_acc, micro_batches_from="--grad-acc",
                               dp=layout.shard_group, zero=layout.zero, recompute=layout.recompute,
                               name=_flag_name)
    return p


def _head_dim(shape) -> int:
    return head_dim_of(shape)


def _tokens(layout: Layout) -> float:
    return layout.mbs * layout.seq / layout.cp


def textbook_layer_activation_bytes(shape, layout: Layout, recompute: str | None = None) -> float:
    """Korthikanti et al. per-layer bytes (bf16 basis, scaled ×2 for fp32)."""
    recompute = recompute or layout.recompute
    s, b, h, a, t = layout.seq / layout.cp, layout.mbs, shape.dim, shape.n_heads, layout.tp
    sbh = s * b * h
    scale = layout.compute_bytes / 2
    if recompute == "full":
        return scale * 2 * sbh / (t if layout.sp else 1)
    attention_scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if t == 1:
        per = 34 + attention_scores
    elif layout.sp:
        per = (34 + attention_scores) / t
    else:
        per = 10 + 24 / t + attention_scores / t
    return scale * sbh * per


def _norm_bytes(tokens: float, width: float, p: int, recompute: str) -> float:
    if recompute == "selective":
        return 2 * p * tokens * width  # input and output; the fp32 internals are recomputed
    return (8 + p) * tokens * width + 4 * tokens + (4 * width if p != 4 else 0)


def per_op_layer_activation_bytes(shape, layout: Layout, recompute: str | None = None) -> float:
    """Bytes ultratron's Llama block saves for backward (see the module docstring for the count)."""
    recompute = recompute or layout.recompute
    p, t = layout.compute_bytes, layout.tp
    tokens = _tokens(layout)
    region = layout.tp if layout.sp else 1  # sequence parallel shards the norm regions
    h, f = shape.dim, shape.ffn_dim
    kv = shape.n_kv_heads * _head_dim(shape)
    if recompute == "full":
        return p * tokens * h / region
    norms = 2 * _norm_bytes(tokens / region, h, p, recompute)
    p_attn = 4 if layout.attention_fp32 else p
    q = shape.n_heads * _head_dim(shape)  # (= h unless the head width is set apart, as in Qwen3)
    attention = p_attn * tokens * (2 * q + 2 * kv) / t + 4 * tokens * shape.n_heads / t  # + log-sum-exp
    if getattr(shape, "qk_norm", False):
        # q_norm / k_norm run per head on the matmul outputs, which are otherwise not saved.
        qk = (q + kv) / t
        attention += p * tokens * qk if recompute == "selective" else 8 * tokens * qk + 4 * tokens * (
            shape.n_heads + shape.n_kv_heads) / t + (8 * _head_dim(shape) if p != 4 else 0)
    mlp = (3 if recompute == "selective" else 4) * p * tokens * f / t
    return norms + attention + mlp + extra_activation_bytes(shape, tokens, p, t, recompute)


def layer_activation_bytes(shape, layout: Layout, model: str = "per-op",
                           recompute: str | None = None) -> float:
    if model == "textbook":
        return textbook_layer_activation_bytes(shape, layout, recompute)
    return per_op_layer_activation_bytes(shape, layout, recompute)


@dataclass(frozen=True)
class PipelineRank:
    """What one pipeline rank runs: its stages, their layers, and whether it holds the ends."""

    rank: int
    stages: list[int]
    layers: list[int]  # per stage, in the order of `stages`
    first: bool
    last: bool

    @property
    def name(self) -> str:
        if self.first and self.last:
            return "only" if len(self.stages) == 1 else "first+last"
        return "first" if self.first else "last" if self.last else "middle"


def pipeline_ranks(shape, layout: Layout) -> list[PipelineRank]:
    """Every pipeline rank's stages and layers, from the trainer's own split and placement."""
    if layout.pp == 1:
        return [PipelineRank(0, [0], [shape.n_layers], True, True)]
    split = stage_split(shape, layout.pp, layout.pp_schedule, layout.virtual_stages, layout.pp_balance,
                        layout.seq, layout.pp_split)
    ranks = stage_ranks(layout.pp_schedule, layout.pp, layout.virtual_stages)
    out = []
    for rank in range(layout.pp):
        stages = rank_stages(layout.pp_schedule, layout.pp, layout.virtual_stages, rank)
        out.append(PipelineRank(rank, stages, [split[s] for s in stages], ranks[0] == rank, ranks[-1] == rank))
    return out


def _rank_params(shape, layout: Layout, where: PipelineRank) -> float:
    counts = count_params_of(shape)
    t = layout.tp
    norms = 2 * shape.dim + (2 * _head_dim(shape) if getattr(shape, "qk_norm", False) else 0)
    routed = routed_expert_params_per_layer(shape)  # split over ep as well
    per_layer = (counts.mean_layer - routed - norms) / t + norms + routed / (layout.ep * t)
    params = sum(where.layers) * per_layer
    if where.first:
        params += counts.embedding / t
    if where.last:
        params += counts.final_norm
        if counts.output or layout.pp > 1:  # a tied head keeps its own copy under pipeline parallel
            params += counts.embedding / t
    return params


def _bytes_per_param(layout: Layout) -> tuple[int, int, int, int, int]:
    """(param, grad, grad-accumulation buffer, master, optimizer) bytes per parameter."""
    if layout.precision == "fp32":
        return 4, 4, 0, 0, 8
    return 2, 2, (4 if layout.fp32_grad_accum else 0), 4, 8


def _rank_memory(shape, layout: Layout, where: PipelineRank, model: str) -> MemoryBreakdown:
    params = _rank_params(shape, layout, where)
    # split experts (ep or tp > 1) are left out of ZeRO's sharding, as the trainer does
    experts = sum(where.layers) * routed_expert_params_per_layer(shape) / (layout.ep * layout.tp) if (
        layout.ep > 1 or layout.tp > 1) else 0.0
    b_param, b_grad, b_accum, b_master, b_optim = _bytes_per_param(layout)
    n = layout.shard_group
    shard = lambda level: n if layout.zero >= level else 1
    states = lambda per_param, level: (params - experts) * per_param / shard(level) + experts * per_param
    p = layout.compute_bytes
    tokens = _tokens(layout)
    t = layout.tp
    h = shape.dim
    kv = shape.n_kv_heads * _head_dim(shape)

    per_layer = layer_activation_bytes(shape, layout, model)
    n_stages = layout.pp * layout.stages_per_rank
    # Bytes one micro-batch leaves alive on each of the rank's stages, and the loss's share of them.
    per_stage, loss_share = [], []
    for stage, layers in zip(where.stages, where.layers, strict=True):
        alive, loss = per_layer * layers, 0.0
        if stage == 0:
            alive += 8 * tokens  # int64 token ids kept by the embedding backward
        if stage == n_stages - 1:
            region_tokens = tokens / (t if layout.sp else 1)
            if model == "per-op":  # the final norm is never inside a recomputed block
                mode = "selective" if layout.recompute == "selective" else "none"
                alive += _norm_bytes(region_tokens, h, p, mode)
            else:
                alive += 2 * p * region_tokens * h  # its input and output
            loss = 4 * tokens * shape.vocab_size / t + 8 * tokens  # log-probs and int64 targets
        per_stage.append(alive + loss)
        loss_share.append(loss)
    in_flight = peak_in_flight(layout.pp_schedule, layout.pp, layout.virtual_stages, layout.grad_acc, where.rank,
                               per_stage)
    loss_logits = sum(k * loss for k, loss in zip(in_flight, loss_share, strict=True))
    activations = sum(k * b for k, b in zip(in_flight, per_stage, strict=True)) - loss_logits
    transient = (p + 4) * tokens * shape.vocab_size / t if where.last else 0.0  # logits + fp32 copy at the loss
    if layout.recompute == "full":
        transient += layer_activation_bytes(shape, layout, model, recompute="none")

    comm = 0.0
    if n > 1 and layout.zero < 3:
        comm += 2 * DDP_BUCKET_BYTES
    if n > 1 and layout.zero == 3:
        layer_params = (count_params_of(shape).mean_layer - routed_expert_params_per_layer(shape)) / t
        comm += 2 * layer_params * b_param + layer_params * 4  # two layers gathered, one reduce-scattered
    if t > 1:
        comm += 2 * p * tokens * h
    if layout.pp > 1:  # torch's stages keep a receive buffer per micro-batch and neighbour on another rank
        ranks = stage_ranks(layout.pp_schedule, layout.pp, layout.virtual_stages)
        remote = sum((s > 0 and ranks[s - 1] != where.rank) + (s < n_stages - 1 and ranks[s + 1] != where.rank)
                     for s in where.stages)
        comm += remote * layout.grad_acc * p * tokens * h / (t if layout.sp else 1)
    if layout.cp > 1:
        comm += 2 * p * tokens * 2 * kv / t
    all_to_all = all_to_all_buffer_bytes(shape, tokens, p, layout.ep)
    comm += all_to_all
    optimizer_temporaries = states(4, 1)
    working = activations + loss_logits + transient
    if optimizer_temporaries > working:
        # The optimizer step runs after backward freed the activations: it sets the peak instead.
        transient = optimizer_temporaries - activations - loss_logits

    return MemoryBreakdown(
        parameters=states(b_param, 3),
        gradients=states(b_grad, 2),
        grad_accum_buffer=states(b_accum, 2),
        master_weights=states(b_master, 1),
        optimizer_states=states(b_optim, 1),
        activations=activations,
        loss_logits=loss_logits,
        comm_buffers=comm,
        transient=max(transient, 0.0),
        stage=where.name,
        extra={"params_on_gpu": params, "pp_rank": where.rank, "stages": where.stages,
               "layers_on_stage": sum(where.layers), "layers_per_stage": where.layers,
               "per_layer_activation_bytes": per_layer, "in_flight_micro_batches": in_flight,
               "activation_model": model, "expert_params_on_gpu": experts, "all_to_all_bytes": all_to_all},
    )


def estimate_memory_per_rank(shape, layout: Layout, activation_model: str = "per-op") -> list[MemoryBreakdown]:
    """Bytes on each pipeline rank (one entry without pp); raises UserError for an impossible layout."""
    problems = check_layout(shape, layout)
    if activation_model not in ACTIVATION_MODELS:
        problems.append(f"activation model {activation_model!r} is not one of {', '.join(ACTIVATION_MODELS)}")
    if problems:
        raise UserError(problems)
    return [_rank_memory(shape, layout, where, activation_model) for where in pipeline_ranks(shape, layout)]


def estimate_memory(shape, layout: Layout, activation_model: str = "per-op") -> MemoryBreakdown:
    """Bytes on the heaviest GPU for one training step; raises UserError for an impossible layout."""
    return max(estimate_memory_per_rank(shape, layout, activation_model), key=lambda m: m.peak_bytes)
