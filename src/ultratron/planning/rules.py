"""The rules a model shape and a parallel layout must obey, written once.

The trainer's config validation, `ParallelDims`, `plan memory` and `plan search` all ask these
functions, so a layout the planner proposes is one the trainer accepts. Torch-free.

Each problem names fields through `name`: the trainer passes config names (`parallel.tp`,
`model.n_heads`), the planner the bare field names (`tp`, `n_heads`), which its flags are named after.
"""

from __future__ import annotations

from collections.abc import Callable

from ultratron.planning.pipeline import LOOPED, SINGLE, SPLIT_BACKWARD, V_SHAPED, parse_split, stages_per_rank

Namer = Callable[[str], str]


def config_name(field: str) -> str:
    """`parallel.tp` → `parallel.tp` (the trainer's config names)."""
    return field


def short_name(field: str) -> str:
    """`parallel.tp` → `tp` (the planner's names)."""
    return field.split(".", 1)[1]


def field_of(shape, name: str, default=0):
    """An optional shape field (MoE, head_dim, ...), its default when absent or unresolved (None)."""
    value = getattr(shape, name, None)
    return default if value is None else value


def head_dim_of(shape) -> int:
    """The attention head width: an explicit `head_dim`, else dim / n_heads."""
    return field_of(shape, "head_dim") or shape.dim // shape.n_heads


def expert_ffn_dim_of(shape) -> int:
    """Each expert's SwiGLU width: an explicit `expert_ffn_dim`, else ffn_dim."""
    return field_of(shape, "expert_ffn_dim") or shape.ffn_dim


def degree_problems(layout, name: Namer = config_name) -> list[str]:
    """What the layout's own fields need of each other: HSDP's replica groups divide dp and shard
    (ZeRO 2 or 3); sequence parallel splits the tensor-parallel ranks' norm regions."""
    p = []
    if layout.dp % layout.dp_replicate:
        p.append(f"{name('parallel.dp_replicate')}={layout.dp_replicate} must divide {name('parallel.dp')}="
                 f"{layout.dp} (HSDP: dp = dp_replicate × dp_shard)")
    elif layout.dp_replicate > 1 and layout.zero < 2:
        p.append(f"{name('parallel.dp_replicate')}={layout.dp_replicate} (HSDP) shards within each replica group, "
                 f"so it needs {name('parallel.zero')} 2 or 3, got {layout.zero}")
    if layout.sp and layout.tp == 1:
        p.append(f"{name('parallel.sp')}=true needs {name('parallel.tp')} > 1 (sequence parallel splits the norm "
                 "regions over the tensor-parallel ranks)")
    return p


def trainer_limits(layout, name: Namer = config_name) -> list[str]:
    """What the trainer cannot run yet, though the planner prices it (another framework runs it):
    compile under tensor parallel — the compiled blocks run forward, but backward fails (torch 2.13,
    CPU; docs/parallel.md). The config refuses it before minutes of compiling; `plan search` never
    proposes it; `plan estimate` prices it and says so."""
    limits = []
    if layout.compile and layout.tp > 1:
        limits.append(f"{name('training.compile')} does not yet work with {name('parallel.tp')}={layout.tp}: the "
                      "compiled blocks' backward fails in DTensor's redistribute (a plain gradient where a DTensor "
                      f"is due); use {name('training.compile')}=false or {name('parallel.tp')}=1")
    if layout.offload_activations and layout.compile:
        limits.append(f"{name('training.offload_activations')} does not yet work with {name('training.compile')}: "
                      "the offload hooks would run inside the compiled blocks; use one of them")
    return limits


def data_parallel_wrapper(dp: int, zero: int, tp: int = 1, pp: int = 1, dp_replicate: int = 1, ep: int = 1) -> str:
    """How the trainer runs data parallelism for a layout (`parallel/data.py`), `dp` the ranks
    it spans (dp·cp under context parallel): "none" (1 rank), "ddp" (zero 0, and zero 1 with
    ZeroRedundancyOptimizer), "fsdp" (FSDP2 `fully_shard`: zero 2 and 3, HSDP, zero 0/1 when dp meets
    tp since DDP takes no DTensor parameters, zero 1 under pp or ep — ZeroRedundancyOptimizer would
    broadcast each rank's own experts to the others) or "replicate" (FSDP2's `replicate`: zero 0 under pp)."""
    if dp == 1:
        return "none"
    if zero >= 2 or dp_replicate > 1 or tp > 1 or ((pp > 1 or ep > 1) and zero == 1):
        return "fsdp"
    return "replicate" if pp > 1 else "ddp"


# ZeRO-3 under gloo (a CPU): a block whose parameters hold this many bytes or more on a rank (fp32,
# after tp) is gathered one linear layer at a time. Each unit costs its own collectives: at dp 4 on
# 2 cores, split, the tiny preset's 3 MB blocks took 2.2x the step time, the 189 MB blocks of
# benchmarks/start_at_scale.py 1.03x (docs/performance.md, "Host memory on a CPU").
PER_LINEAR_FROM_BYTES = 64 * 2**20


def gathers_per_linear(block_bytes: float) -> bool:
    """Whether ZeRO-3 on a CPU makes each linear layer of a block of `block_bytes` its own unit."""
    return block_bytes >= PER_LINEAR_FROM_BYTES


def reduces_every_micro_batch(layout) -> bool:
    """ZeRO-3 without pp reduce-scatters each micro-batch's gradients and adds up the shards
    (`parallel/data.py`, `DataAxis.micro_batch_context`); every other data-parallel layout reduces
    once a step, on the last micro-batch (torch's stages: after the schedule)."""
    return layout.zero == 3 and layout.pp == 1


def shape_problems(shape, name: Namer = config_name) -> list[str]:
    """Heads must divide the width (unless the head width is given), with an even head dimension;
    kv heads must divide heads; a mixture of experts needs 1 ≤ top-k ≤ experts and a MoE layer."""
    p: list[str] = []
    explicit = field_of(shape, "head_dim")
    if explicit < 0:
        p.append(f"{name('model.head_dim')} must be ≥ 0 (0: dim / n_heads), got {explicit}")
    elif explicit and explicit % 2:
        p.append(f"{name('model.head_dim')}={explicit} must be even for rotary embeddings")
    elif not explicit and shape.dim % shape.n_heads:
        p.append(f"{name('model.n_heads')}={shape.n_heads} does not divide {name('model.dim')}={shape.dim}")
    elif not explicit and (shape.dim // shape.n_heads) % 2:
        p.append(f"head dimension {shape.dim // shape.n_heads} ({name('model.dim')}/{name('model.n_heads')}) "
                 "must be even for rotary embeddings")
    if shape.n_heads % shape.n_kv_heads:
        p.append(f"{name('model.n_kv_heads')}={shape.n_kv_heads} does not divide "
                 f"{name('model.n_heads')}={shape.n_heads} (grouped-query attention shares each kv head "
                 "among n_heads/n_kv_heads query heads)")
    return p + moe_problems(shape, name)


def moe_problems(shape, name: Namer = config_name) -> list[str]:
    experts = field_of(shape, "n_experts")
    moe_fields = ("n_experts", "n_active_experts", "n_shared_experts", "expert_ffn_dim", "n_dense_layers")
    p = [f"{name('model.' + f)} must be ≥ 0, got {field_of(shape, f)}" for f in moe_fields
         if field_of(shape, f) < 0]
    if p:
        return p
    if experts == 0:
        return [f"{name('model.' + f)}={getattr(shape, f)} needs {name('model.n_experts')} > 0 (a mixture of "
                f"experts)" for f in moe_fields[1:] if field_of(shape, f) > 0]
    p += [f"{name('model.' + f)} must be ≥ 0 (0 disables), got {field_of(shape, f)}"
          for f in ("moe_aux_loss", "moe_bias_update", "moe_capacity_factor") if field_of(shape, f) < 0]
    if 0 < field_of(shape, "moe_capacity_factor") < 1:
        p.append(f"{name('model.moe_capacity_factor')}={shape.moe_capacity_factor} is below an even share (1.0): "
                 "even perfectly balanced routing would drop tokens; use ≥ 1 (e.g. 1.25) or 0 for dropless")
    top_k = field_of(shape, "n_active_experts")
    if not 1 <= top_k <= experts:
        p.append(f"{name('model.n_active_experts')}={top_k} must lie in [1, {name('model.n_experts')}={experts}]")
    if field_of(shape, "n_dense_layers") >= shape.n_layers:
        p.append(f"{name('model.n_dense_layers')}={shape.n_dense_layers} leaves no mixture-of-experts layer of "
                 f"{name('model.n_layers')}={shape.n_layers}")
    return p


def layout_problems(shape, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, seq: int | None = None,
                    dp: int | None = None, dp_replicate: int = 1, name: Namer = config_name) -> list[str]:
    """What a layout needs of the model: tp divides heads, kv heads, FFN widths and vocabulary
    (each rank keeps an equal slice of each); pp at most one stage per layer; cp cuts the sequence
    into 2·cp equal chunks (the causal balance); ep divides the experts and borrows its ranks from
    data parallelism, so it divides dp (within an HSDP group: dp / dp_replicate)."""
    p: list[str] = []
    moe = field_of(shape, "n_experts") > 0
    widths = ("ffn_dim", "expert_ffn_dim") if moe and field_of(shape, "expert_ffn_dim") else ("ffn_dim",)
    heads = ("n_heads", "n_kv_heads") if shape.n_heads % tp or shape.n_kv_heads % tp else ()
    undivided = [*heads, *(f for f in (*widths, "vocab_size") if getattr(shape, f) % tp)]
    if undivided:
        listed = [f"{name('model.' + f)}={getattr(shape, f)}" for f in undivided]
        joined = listed[0] if len(listed) == 1 else ", ".join(listed[:-1]) + " and " + listed[-1]
        p.append(f"{name('parallel.tp')}={tp} does not divide {joined}")
    if pp > shape.n_layers:
        p.append(f"{name('parallel.pp')}={pp} exceeds {name('model.n_layers')}={shape.n_layers}")
    if cp > 1 and seq is not None and seq % (2 * cp):
        p.append(f"{name('parallel.cp')}={cp} does not divide the sequence length {seq} into 2·cp = {2 * cp} equal "
                 "chunks (the causal balance gives each context-parallel rank two of them)")
    if cp > 1 and field_of(shape, "attn_softcap") > 0:
        p.append(f"{name('parallel.cp')}={cp} needs fused attention, which has no soft-cap: set "
                 f"{name('model.attn_softcap')} 0")
    if ep > 1 and not moe:
        p.append(f"{name('parallel.ep')}={ep} needs a mixture-of-experts model; this model is dense "
                 f"(use {name('parallel.ep')}=1)")
    elif ep > 1:
        if shape.n_experts % ep:
            p.append(f"{name('parallel.ep')}={ep} does not divide {name('model.n_experts')}={shape.n_experts} "
                     "(each expert-parallel rank holds an equal share of the experts)")
        group = None if dp is None else dp // max(dp_replicate, 1)
        if group is not None and group % ep:
            within = f" / {name('parallel.dp_replicate')}={dp_replicate}" if dp_replicate > 1 else ""
            p.append(f"{name('parallel.ep')}={ep} does not divide {name('parallel.dp')}={dp}{within}: expert "
                     f"parallelism borrows its ranks from data parallelism (the world stays dp × tp × pp × cp)")
    return p


def pipeline_problems(shape, *, pp: int, schedule: str, virtual_stages: int = 0, split: str | None = None,
                      micro_batches: int | None = None, micro_batches_from: str = "", dp: int = 1, zero: int = 0,
                      recompute: str = "none", name: Namer = config_name, fill: bool = True) -> list[str]:
    """What a pipeline layout needs: stages per rank the schedule can run, at least one layer per
    stage, an explicit split that adds up, and enough micro-batches per step to fill the pipeline
    (too few is refused here rather than left to hang or fail inside the schedule; `fill=False`
    lets it through, for a planner that prices it anyway: `pipeline_fill_problem`).
    `micro_batches_from` says where the micro-batch count comes from, for the message."""
    p: list[str] = []
    v_name, s_name, split_name = name("parallel.pp_virtual_stages"), name("parallel.pp_schedule"), name(
        "parallel.pp_split")
    if pp == 1:
        if split:
            p.append(f"{split_name}={split} needs {name('parallel.pp')} > 1")
        return p
    if virtual_stages < 0:
        return [f"{v_name} must be ≥ 0 (0: the schedule's own), got {virtual_stages}"]
    if schedule in SINGLE and virtual_stages > 1:
        p.append(f"{v_name}={virtual_stages} needs a schedule with several stages per rank "
                 f"({', '.join(LOOPED + V_SHAPED)}); {s_name}={schedule} runs one")
    elif schedule in LOOPED and virtual_stages == 1:
        p.append(f"{s_name}={schedule} runs several stages per rank: set {v_name} ≥ 2 (or 0 for 2)")
    elif schedule in V_SHAPED and virtual_stages not in (0, 2):
        p.append(f"{s_name}={schedule} runs exactly 2 stages per rank (a V); set {v_name} to 2 or 0")
    if schedule in SPLIT_BACKWARD and dp > 1 and zero == 3:
        # Measured here: the weight gradients come out wrong, as the next micro-batch's forward
        # frees the gathered weights the deferred weight backward reads (torchtitan, too, keeps
        # parameters gathered after forward under pp).
        p.append(f"{name('parallel.zero')}=3 frees the gathered parameters after each forward, which "
                 f"{s_name}={schedule} still needs for its deferred weight backward; use {name('parallel.zero')} 2 "
                 f"(gradients and optimizer state stay sharded) or gpipe, 1f1b or interleaved-1f1b")
    if schedule in SPLIT_BACKWARD and recompute == "selective":
        # torch's selective checkpoint lets a recomputed region run backward once (measured here)
        p.append(f"{name('training.recompute')}=selective lets each recomputed region run backward once, but "
                 f"{s_name}={schedule} runs backward in two passes (inputs, then weights); use "
                 f"{name('training.recompute')} full or none, or gpipe, 1f1b or interleaved-1f1b")
    if p:
        return p
    per_rank = stages_per_rank(schedule, virtual_stages)
    stages = pp * per_rank
    layers = name("model.n_layers")
    if split:
        counts = parse_split(split)
        if counts is None or any(c < 1 for c in counts):
            p.append(f"{split_name}={split!r} must list positive layer counts, comma-separated (e.g. 3,5)")
        elif len(counts) != stages:
            p.append(f"{split_name}={split!r} has {len(counts)} entries; the pipeline has {stages} stages "
                     f"({name('parallel.pp')}={pp} × {per_rank} per rank)")
        elif sum(counts) != shape.n_layers:
            p.append(f"{split_name}={split!r} adds up to {sum(counts)} layers; {layers}={shape.n_layers}")
    elif stages > shape.n_layers >= pp:  # (pp > n_layers itself is layout_problems' line)
        p.append(f"{name('parallel.pp')}={pp} × {per_rank} stages per rank = {stages} stages exceed "
                 f"{layers}={shape.n_layers}: every stage needs a layer")
    elif per_rank > 1 and shape.n_layers % stages:
        # Megatron-LM's rule for its interleaved schedule: layers divide into pp × v equal chunks.
        p.append(f"{name('parallel.pp')}={pp} × {per_rank} stages per rank = {stages} stages do not divide "
                 f"{layers}={shape.n_layers}: choose {v_name} so that pp × it divides the layers, or give "
                 f"{split_name}")
    if micro_batches is not None:
        underfilled = pipeline_fill_problem(pp=pp, schedule=schedule, virtual_stages=virtual_stages,
                                            micro_batches=micro_batches, micro_batches_from=micro_batches_from,
                                            name=name)
        if underfilled:
            p += [underfilled] if fill else []
        elif schedule in LOOPED and micro_batches % (micro_batches // pp):
            rounds = micro_batches // pp
            source = f" ({micro_batches_from})" if micro_batches_from else ""
            p.append(f"{micro_batches} micro-batches per step{source}: {s_name}={schedule} runs them in "
                     f"{rounds} rounds of at least {name('parallel.pp')}={pp}, so they must be a multiple of "
                     f"{rounds}; a multiple of {pp} always works (e.g. {rounds * pp} or {(rounds + 1) * pp})")
    return p


def pipeline_fill_problem(*, pp: int, schedule: str, virtual_stages: int, micro_batches: int,
                          micro_batches_from: str = "", name: Namer = config_name) -> str | None:
    """The line for a pipeline whose micro-batches per step are too few to fill it (None when they
    are enough): every stage needs one in flight (torch's DualPipeV one per stage of its V)."""
    stages = pp * stages_per_rank(schedule, virtual_stages)
    need = stages if schedule == "dualpipev" else pp
    if pp == 1 or micro_batches >= need:
        return None
    source = f" ({micro_batches_from})" if micro_batches_from else ""
    what = f"{stages} stages" if schedule == "dualpipev" else f"{pp} pipeline stages"
    plural = "micro-batch" if micro_batches == 1 else "micro-batches"
    return (f"{micro_batches} {plural} per step{source} are fewer than the {what}: "
            f"{name('parallel.pp_schedule')}={schedule} needs at least {need} to fill the pipeline")
