"""Work the spawned ranks of the distributed tests run: a list of training runs, one after another,
in the same process group (a fresh DeviceMesh each), so one launch covers several layouts."""

from __future__ import annotations


def train_runs(runs: list[list[str]]) -> None:
    import torch.distributed as dist

    from ultratron.config import load_config
    from ultratron.training.trainer import train

    for overrides in runs:
        train(load_config(None, overrides), echo=False)
        assert dist.is_initialized()  # the caller's group (launch.local's) outlives each run


def measure_zero_stages(base: list[str], out_dir: str) -> None:
    """For zero 0..3 under dp2: bytes of parameters, gradients (after backward) and optimizer state
    (after a step) this rank holds, written to out_dir/rank<r>.json."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from ultratron.config import load_config
    from ultratron.parallel.memory import measured_bytes
    from ultratron.training.loss import cross_entropy
    from ultratron.training.trainer import Trainer

    results = {}
    for zero in range(4):
        trainer = Trainer(load_config(None, base + ["--parallel.dp", "2", "--parallel.zero", str(zero),
                                                    "--run.dir", f"{out_dir}/zero{zero}"]), echo=False)
        inputs, targets = trainer.train_loader.next_batch()
        with trainer.axes.step_context(training=True), trainer.axes.micro_batch_context(last=True):
            cross_entropy(trainer.model(inputs), targets)[0].backward()
        after_backward = measured_bytes(trainer.model, trainer.optimizer)
        trainer.optimizer.step()
        after_step = measured_bytes(trainer.model, trainer.optimizer)
        results[zero] = {"parameters": after_step["parameters"], "gradients": after_backward["gradients"],
                         "optimizer_states": after_step["optimizer_states"]}
        if zero < 2:  # DDP: two of the trainer's own steps (DDP rebuilds its buckets before the
            # second); where do the gradients live then?
            trainer.train_step()
            trainer.train_step()
            grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
            storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}
            results[zero].update(params=sum(1 for _ in trainer.model.parameters()), grads_kept=len(grads),
                                 grad_storages=len(storages), grad_storage_bytes=sum(storages.values()))
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


def measure_pipeline_memory(base: list[str], schedules: list[str], out_dir: str) -> None:
    """For each schedule under pp2: this rank's parameter, gradient and optimizer bytes and the peak
    of the activations its schedule keeps alive (the second step, after torch's first-step shape
    inference), written to out_dir/rank<r>.json."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from ultratron.config import load_config
    from ultratron.parallel.memory import SavedActivations, measured_bytes
    from ultratron.training.trainer import Trainer

    results = {}
    for schedule in schedules:
        trainer = Trainer(load_config(None, base + ["--parallel.pp", "2", "--parallel.pp_schedule", schedule,
                                                    "--run.dir", f"{out_dir}/{schedule}"]), echo=False)
        trainer.train_step()
        m = trainer.cfg.grad_accum_steps
        with SavedActivations(trainer.model) as meter:
            trainer.strategy.forward_backward(trainer.train_loader.next_batch, m)
        after_backward = measured_bytes(trainer.model, trainer.optimizer)
        trainer.optimizer.step()
        results[schedule] = {"parameters": after_backward["parameters"], "gradients": after_backward["gradients"],
                             "optimizer_states": measured_bytes(trainer.model, trainer.optimizer)["optimizer_states"],
                             "activations": meter.peak, "left_alive": meter.live}
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


def ring_attention_errors(out_dir: str) -> None:
    """On 4 ranks: context-parallel attention (ring and all-gather, cp 2 and 4, multi-head and
    grouped-query causal, grouped-query document-masked) against the attention of the whole sequence in one
    process — the largest absolute difference of the output and of the q, k, v gradients, written
    to out_dir/rank<r>.json."""
    import json
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from ultratron.models.attention import attend, reference_attention
    from ultratron.models.masks import MaskSpec
    from ultratron.parallel.context import ContextParallelAttention, shard_sequence, unshard_sequence

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # (every rank creates every group)
    # Two packed rows of 64: documents that end inside chunks (a one-token one too), and documents
    # that end on chunk boundaries, so that whole blocks and single query rows of a block see no key.
    documents = torch.repeat_interleave(torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 4, 4]]),
                                        torch.tensor([[7, 13, 1, 20, 23], [16, 1, 15, 16, 16]]).flatten()
                                        ).view(2, 64)
    results = {}
    for cp in (2, 4):
        group, cp_rank = (dist.group.WORLD, rank) if cp == 4 else (pairs[rank // 2], rank % 2)
        for mode in ("ring", "allgather"):
            for heads, kv_heads in ((4, 4), (4, 2)):
                # (documents, sliding windows: GQA only; a window of 12 ends inside chunks of 8 or 16)
                for masked in ("", "-documents", "-window", "-documents-window") if kv_heads < heads else ("",):
                    torch.manual_seed(cp * 10 + kv_heads)  # the same tensors on every rank
                    q, k, v = (torch.randn(2, h, 64, 16) for h in (heads, kv_heads, kv_heads))
                    weight = torch.randn(2, heads, 64, 16)
                    full = [t.clone().requires_grad_() for t in (q, k, v)]
                    spec = MaskSpec(documents=documents if "documents" in masked else None,
                                    window=12 if "window" in masked else 0)
                    out = reference_attention(*full, spec, heads // kv_heads)  # the dense mask, one process
                    (out * weight).sum().backward()
                    local = [shard_sequence(t, cp, cp_rank, dim=2).requires_grad_() for t in (q, k, v)]
                    attention = ContextParallelAttention(group, cp_rank, cp, mode, local=attend)
                    attention.active = True
                    mine = attention(*local, spec, heads // kv_heads)
                    (mine * shard_sequence(weight, cp, cp_rank, dim=2)).sum().backward()
                    errors = {}
                    for name, got, expected in (("out", mine.detach(), out.detach()),
                                                *((f"d{n}", t.grad, f.grad) for n, t, f in zip("qkv", local, full,
                                                                                                 strict=True))):
                        shards = [torch.empty_like(got) for _ in range(cp)]
                        dist.all_gather(shards, got.contiguous(), group=group)
                        errors[name] = float((unshard_sequence(shards, dim=2) - expected).abs().max())
                        errors[name + "_scale"] = float(expected.abs().max())
                    heads_name = "gqa" if kv_heads < heads else "mha"
                    results[f"cp{cp}-{mode}-{heads_name}" + masked] = errors
            if cp == 2:
                results[f"model-cp2-{mode}"] = _document_logits_errors(documents, group, cp_rank, mode)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def _document_logits_errors(documents, group, cp_rank: int, mode: str) -> dict:
    """A 2-layer Llama on the packed rows under cp2 (the axis' shard, the model's forward as the
    trainer calls it): the largest difference of each document's logits from the document alone in
    one process, and (that the documents matter) from the rows' plain causal logits."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from ultratron.models.attention import attend
    from ultratron.models.llama import Llama, LlamaArgs
    from ultratron.models.registry import plan_of
    from ultratron.parallel.axis import MicroBatch
    from ultratron.parallel.context import ContextAxis, ContextParallelAttention, unshard_sequence

    torch.manual_seed(0)
    model = Llama(LlamaArgs(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97,
                            max_seq_len=64, init_std=0.2)).eval()
    tokens = torch.randint(0, 97, documents.shape)
    attention = ContextParallelAttention(group, cp_rank, 2, mode, local=attend)
    plan_of(model).set_attention(model, attention)
    axis = ContextAxis(attention, SimpleNamespace(cp=2, cp_rank=cp_rank))

    def sharded(docs):
        batch = axis.shard(MicroBatch(tokens, tokens, documents=docs))
        with torch.no_grad(), axis.step_context(training=False):
            mine = model(batch.inputs, positions=batch.positions, documents=batch.documents)
        shards = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(shards, mine.contiguous(), group=group)
        return unshard_sequence(shards)

    packed, plain = sharded(documents), sharded(None)
    worst = gap = 0.0
    with torch.no_grad():
        for row in range(documents.shape[0]):
            spans = torch.unique_consecutive(documents[row], return_counts=True)[1].cumsum(0).tolist()
            for a, b in zip([0] + spans[:-1], spans, strict=True):
                alone = model(tokens[row:row + 1, a:b])[0]  # (the attention is local outside the step)
                worst = max(worst, float((packed[row, a:b] - alone).abs().max()))
                gap = max(gap, float((plain[row, a:b] - alone).abs().max()))
    return {"logits": worst, "plain": gap}


def measure_step_memory(base: list[str], layouts: list[list[str]], out_dir: str) -> None:
    """For each layout, `micro_batch_memory` of a trainer built for it, written to
    out_dir/rank<r>.json, one entry per layout."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from ultratron.config import load_config
    from ultratron.training.trainer import Trainer

    results = []
    for i, flags in enumerate(layouts):
        trainer = Trainer(load_config(None, base + flags + ["--run.dir", f"{out_dir}/layout{i}"]), echo=False)
        results.append(micro_batch_memory(trainer))
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


def micro_batch_memory(trainer) -> dict[str, int]:
    """The bytes this rank's second micro-batch of a step leaves alive after its forward
    (`parallel.memory.LiveTensors`: every tensor ops created, gloo's outputs included), the token ids
    and targets added ("step"), and of those the bytes the second block created ("layer")."""
    from ultratron.parallel.memory import LiveTensors
    from ultratron.training.loss import cross_entropy
    from ultratron.training.precision import autocast

    model, axes, device, precision = trainer.model, trainer.axes, trainer.device, trainer.cfg.training.precision
    block = next(module for name, module in model.named_modules() if name.endswith("layers.1"))
    inputs, targets = trainer.train_loader.next_batch()
    for _ in range(2):  # the first micro-batch allocates the gradients; the second is measured
        with axes.step_context(training=True), axes.micro_batch_context(last=False):
            layer = LiveTensors(model)
            hooks = layer.during(block)
            with LiveTensors(model) as meter:
                with autocast(precision, device):
                    logits = model(inputs)
                loss, _ = cross_entropy(logits, targets)
                del logits  # training.step hands the logits to the loss and keeps no reference to them
            alive = {"step": meter.alive() + (inputs.numel() + targets.numel()) * 8, "layer": layer.alive()}
            for hook in hooks:
                hook.remove()
            loss.backward()
        del loss
    return alive


def train_joining_the_group_itself(base: list[str], out_dir: str) -> None:
    """As under torchrun (launch.local with join_group=False): `train` joins the group, trains and
    leaves it; rank<r>.json records whether a group was still there after it."""
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist

    from ultratron.config import load_config
    from ultratron.training.trainer import train

    result = train(load_config(None, base + ["--parallel.dp", "2", "--run.dir", f"{out_dir}/run"]), echo=False)
    Path(out_dir, f"rank{os.environ['RANK']}.json").write_text(json.dumps(
        {"steps": result.steps_done, "group_after": dist.is_initialized()}))


def write_environment(names: list[str], out_dir: str) -> None:
    """The values of environment variables `names` (None: unset) and RANK, as this rank sees them,
    written to out_dir/rank<r>.json."""
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    values = {name: os.environ.get(name) for name in [*names, "RANK"]}
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(values))


def grad_norms(base: list[str], layouts: list[list[str]], out_dir: str) -> None:
    """For each layout, after one step's forward and backward: the global gradient norm the trainer
    clips by, the norm of every parameter's whole gradient (DTensors gathered, each parameter once,
    tied copies left out, in float64), and the parameters whose gradient is still a partial sum,
    written to out_dir/rank<r>.json."""
    import json
    import math
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ultratron.config import load_config
    from ultratron.training.trainer import Trainer

    results = []
    for i, flags in enumerate(layouts):
        trainer = Trainer(load_config(None, base + flags + ["--run.dir", f"{out_dir}/layout{i}"]), echo=False)
        trainer.strategy.forward_backward(trainer.train_loader.next_batch, trainer.cfg.grad_accum_steps)
        uncounted = {id(p) for axis in trainer.axes for p in axis.uncounted()}
        whole = 0.0
        partial = [n for n, p in trainer.model.named_parameters()
                   if isinstance(p.grad, DTensor) and any(x.is_partial() for x in p.grad.placements)]
        for param in {id(p): p for p in trainer.model.parameters()}.values():
            if param.grad is None or id(param) in uncounted:
                continue
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            whole += float(grad.double().pow(2).sum())
        if trainer.dims.pp > 1:  # each pipeline rank holds other layers
            total = torch.tensor(whole, dtype=torch.float64)
            dist.all_reduce(total, group=trainer.dims.pp_group)
            whole = float(total)
        results.append({"clipped_by": float(trainer.axes.clip_grad_norm(math.inf)), "whole": math.sqrt(whole),
                        "partial": partial})
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


def record_sequence_ids(rank: int):
    """From now on every training loader of this process appends the sequence ids each optimizer
    step reads to RUN_DIR/ids-rank<rank>.jsonl ({"step", "ids"}; a mixture's ids are
    [source, index]); returns the function that undoes it."""
    import json
    from pathlib import Path

    from ultratron.data.loader import TokenLoader
    from ultratron.data.mixture import MixtureLoader
    from ultratron.training.trainer import Trainer

    current: dict = {}
    originals = {cls: cls.next_indices for cls in (TokenLoader, MixtureLoader)}
    train_step = Trainer.train_step

    def stepping(self):
        current.update(loader=self.train_loader, step=self.step + 1, ids=[])
        record = train_step(self)
        with open(Path(self.run_dir) / f"ids-rank{rank}.jsonl", "a", encoding="utf-8") as out:
            out.write(json.dumps({"step": current["step"], "ids": current["ids"]}) + "\n")
        return record

    def recording(cls):
        def next_indices(self):
            ids = originals[cls](self)
            if self is current.get("loader"):
                current["ids"] += [[int(v) for v in i] if isinstance(i, tuple) else int(i) for i in ids]
            return ids
        return next_indices

    Trainer.train_step = stepping
    for cls in originals:
        cls.next_indices = recording(cls)

    def undo():
        Trainer.train_step = train_step
        for cls, fn in originals.items():
            cls.next_indices = fn
    return undo


def train_runs_recording_ids(runs: list[list[str]]) -> None:
    """`train_runs`, each step's sequence ids recorded (`record_sequence_ids`)."""
    import torch.distributed as dist

    record_sequence_ids(dist.get_rank())
    train_runs(runs)


def measure_forward_backward_peak(base: list[str], flags: list[str], out_dir: str) -> None:
    """The peak bytes (torch's MemTracker, as `ultratron simulate` measures it) of a step's forward
    and backward over every micro-batch and the gradient clipping, the step after a first one that
    created the optimizer state; written to out_dir/rank<r>.json."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from ultratron.config import load_config
    from ultratron.simulate.measure import memory_tracker, total
    from ultratron.training.trainer import Trainer

    trainer = Trainer(load_config(None, base + flags + ["--run.dir", f"{out_dir}/run"]), echo=False)
    trainer.train_step()
    tracker = memory_tracker()
    tracker.track_external(trainer.model, trainer.optimizer)
    with tracker:
        trainer.strategy.forward_backward(trainer.train_loader.next_batch, trainer.cfg.grad_accum_steps)
        trainer.axes.clip_grad_norm(trainer.cfg.training.grad_clip)
    peak = total(tracker.get_tracker_snapshot("peak"))
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps({"peak_bytes": peak}))


def measure_offloaded_bytes(base: list[str], layouts: list[list[str]], out_dir: str) -> None:
    """For each layout (with training.offload_activations on), a model `parallelize` builds for it
    runs two micro-batches of the same random tokens (the same on every rank) forward and backward;
    [bytes moved to the host in forward, bytes returned in backward] of each (`Parallel.host`), one
    entry per layout, written to out_dir/rank<r>.json. Also runs in one process (rank 0)."""
    import json
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from ultratron.config import load_config
    from ultratron.models.registry import build_model
    from ultratron.parallel.parallelize import parallelize, topology
    from ultratron.training.precision import autocast

    results = []
    for flags in layouts:
        cfg = load_config(None, base + flags)
        dims = topology(cfg.layout)
        device = dims.init_distributed(torch.device("cpu"))
        torch.manual_seed(0)
        parallel = parallelize(build_model(cfg.model), dims, cfg)
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.training.micro_batch_size, cfg.training.seq_len))
        moved = []
        for last in (False, True):  # (ZeRO-2/3 reshard and reduce only after the last)
            parallel.host.reset()
            with parallel.axes.step_context(training=True), parallel.axes.micro_batch_context(last=last):
                with autocast(cfg.training.precision, device):
                    loss = parallel.model(tokens).float().logsumexp(-1).mean()
                forward = parallel.host.moved
                loss.backward()
            moved.append([forward, parallel.host.returned])
        results.append(moved)
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def compare_initial_shards(base: list[str], layouts: list[list[str]], out_dir: str) -> None:
    """For each layout: the model `parallelize` builds from the meta device (materialized and
    initialized shard by shard) against one process's initialization of the whole model (`Llama`
    built on the CPU, LoRA's adapters as `apply_lora` draws them): how many local shards this rank
    holds, how many elements they hold, and the names of those not bitwise equal to the same rows
    and columns of the whole. Written to out_dir/rank<r>.json, one entry per layout."""
    import json
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from ultratron.config import load_config
    from ultratron.models.lora import apply_lora
    from ultratron.models.registry import build_model, plain_name, plan_of, unwrap
    from ultratron.parallel.materialize import local_region
    from ultratron.parallel.parallelize import parallelize, topology

    results = []
    for flags in layouts:
        lora = None
        if "--lora.rank" in flags:
            at = flags.index("--lora.rank")
            lora, flags = flags[at + 1], flags[:at] + flags[at + 2:]
        cfg = load_config(None, base + flags)
        if lora is not None:  # adapters with no base checkpoint (a config refuses that): only their init matters
            cfg.lora.rank = int(lora)
        dims = topology(cfg.layout)
        device = dims.init_distributed(torch.device("cpu"))
        parallel = parallelize(build_model(cfg.model, "meta"), dims, cfg, device)
        torch.manual_seed(cfg.training.seed)
        whole = build_model(cfg.model, "cpu")
        if cfg.lora.rank > 0:
            apply_lora(whole, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets, plan_of(whole).lora_targets)
        reference = dict(whole.named_parameters())
        copies = getattr(unwrap(parallel.model), "tied_copies", {})
        shards, elements, unequal = 0, 0, []
        for name, param in parallel.model.named_parameters():
            source = copies.get(plain_name(name), plain_name(name))
            local, region = local_region(param)
            expected = reference[source][tuple(slice(a, b) for a, b in region)]
            shards, elements = shards + 1, elements + local.numel()
            if local.dtype != torch.float32 or not torch.equal(local, expected):
                unequal.append(source)
        results.append({"shards": shards, "elements": elements, "unequal": unequal})
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
