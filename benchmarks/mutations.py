"""Mutation testing: plant one small, realistic bug at a time in a copy of the repository, run the
tests that should guard it, and report which test caught it — or that none did (MISSED).

  python benchmarks/mutations.py --list                       # the mutations and their guarding tests
  python benchmarks/mutations.py --check                      # each edit still applies exactly once (no tests)
  python benchmarks/mutations.py --single-process             # the mutations guarded by one-process tests
  python benchmarks/mutations.py --only accum-loss-scale,clip-not-applied
  python benchmarks/mutations.py --results runs/mutations.jsonl --resume     # a long run, resumable
  python benchmarks/mutations.py --baseline                   # first: the guards pass without any mutation

Each mutation is one exact edit — an old string that must occur exactly once in its file, and the
string that replaces it — so that the list fails loudly (status `stale`) instead of silently
testing nothing when the code changes under it. The edit is made in a temporary copy of the
repository (git's tracked and untracked-but-not-ignored files), never in the files here: an
interrupted run leaves nothing planted, at most a temporary directory `ultratron-mutant-*` (removed
on a normal exit, Ctrl-C or SIGTERM). The tests run in the copy with `PYTHONPATH=<copy>/src`
first, so spawned ranks and `python -m ultratron` subprocesses import the mutant too; each copy is
checked to import its own `ultratron` before its tests run.

Outcomes: `caught` (a guarding test failed or errored; the table names them, "(errored)" where the
bug crashed a test or its fixture rather than failing an assertion), MISSED
(every guarding test passed with the bug planted), `timeout` (the tests ran past --timeout; a
hang the bug causes shows up here), `stale` (the edit no longer applies: update the list),
`error` (pytest itself could not run, e.g. a collection error), `skipped` (the tests were
skipped). Pytest runs without -x unless --first-failure, so a mutation caught by some of its
tests and passed by others (a bf16 tolerance wider than the bug) says so: "2/3 failed".
Times are wall-clock seconds of the mutation's test run (the guards of the distributed axes
launch several multi-process trainings in their module fixtures, minutes each on a small CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = "src/ultratron"

EQ = "tests/distributed/test_dist_equivalence.py"
CPEP = "tests/distributed/test_dist_cp_ep.py"
PIPE = "tests/distributed/test_dist_pipeline.py"
CP = "tests/distributed/test_dist_context_parallel.py"
CHAT = "tests/distributed/test_dist_chat_lora.py"
CLIP_TEST = "tests/test_train_run.py::test_clipping_scales_the_update_and_logs_the_norm_before_it"
COSINE_TEST = "tests/test_schedule.py::test_linear_warmup_then_cosine_to_the_floor"
PP_1F1B = f"{PIPE}::test_pp2_with_each_schedule_equals_one_process[pp2-1f1b-fp32]"
REMOTE = "tests/test_remote_shards.py"


@dataclass(frozen=True)
class Mutation:
    id: str
    path: str  # relative to the repository root
    description: str
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids (or files) that should catch it
    note: str = ""


MUTATIONS = [
    # ---- the step: gradient accumulation ----
    Mutation("accum-loss-scale", f"{SRC}/parallel/axis.py",
             "micro-batch loss not divided by the micro-batch count before backward",
             "(loss / len(batches)).backward()", "loss.backward()",
             ("tests/test_grad_accum.py",)),
    Mutation("accum-mean-loss", f"{SRC}/parallel/axis.py",
             "the step's loss returned as the sum over micro-batches, not their mean",
             "        return total / len(batches)", "        return total",
             ("tests/test_grad_accum.py",)),
    Mutation("moe-aux-weight", f"{SRC}/parallel/axis.py",
             "MoE balancing-loss gradient not weighted by 1/micro-batches under accumulation",
             "        return 1.0 / n_micro_batches", "        return 1.0",
             ("tests/test_grad_accum.py::test_the_moe_balancing_loss_takes_a_micro_batchs_share_of_the_step",)),
    # ---- gradient norm and clipping ----
    Mutation("norm-replicated-sum", f"{SRC}/parallel/grads.py",
             "gradient norm: a bucket's square sum also summed over replicated mesh dimensions",
             "sharded = tuple(i for i, p in enumerate(grad.placements) if not isinstance(p, (Replicate, Partial)))",
             "sharded = tuple(range(len(grad.placements)))",
             (f"{EQ}::test_the_clipped_norm_is_the_norm_of_the_whole_gradients",)),
    Mutation("norm-sqrt-dropped", f"{SRC}/parallel/grads.py",
             "gradient norm returned squared (sqrt dropped)",
             "    return total.sqrt()", "    return total",
             (CLIP_TEST,)),
    Mutation("norm-pp-not-summed", f"{SRC}/parallel/grads.py",
             "gradient norm not summed over the pipeline stages (each rank counts its own stage)",
             "    for group in groups:\n        dist.all_reduce(total, group=group)\n", "",
             (f"{EQ}::test_the_clipped_norm_is_the_norm_of_the_whole_gradients[pp2]", PP_1F1B)),
    Mutation("clip-coef-wrong", f"{SRC}/parallel/grads.py",
             "clipping coefficient computed from the squared norm",
             "coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)",
             "coef = (max_norm / (norm ** 2 + 1e-6)).clamp(max=1.0)",
             (CLIP_TEST,)),
    Mutation("clip-not-applied", f"{SRC}/parallel/grads.py",
             "clipping never applied (the coefficient floored at 1 as well as capped there)",
             "            grad.mul_(coef.to(grad.device))",
             "            grad.mul_(coef.clamp(min=1.0).to(grad.device))",
             (CLIP_TEST,)),
    # ---- learning-rate schedule and optimizer ----
    Mutation("lr-warmup-off-by-one", f"{SRC}/training/optim.py",
             "warmup off by one: the first step runs at lr 0",
             "return peak * (step + 1) / warmup", "return peak * step / warmup",
             (COSINE_TEST,)),
    Mutation("lr-cosine-floor", f"{SRC}/training/optim.py",
             "cosine decays to 0 instead of lr·min_lr_ratio",
             "return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))",
             "return peak * 0.5 * (1.0 + math.cos(math.pi * progress))",
             (COSINE_TEST,)),
    Mutation("lr-cosine-last-step", f"{SRC}/training/optim.py",
             "cosine span off by one: the last step stops short of the floor",
             "span = max(1, total_steps - warmup - 1)", "span = max(1, total_steps - warmup)",
             (COSINE_TEST,)),
    Mutation("optim-decay-on-norms", f"{SRC}/training/optim.py",
             "weight decay applied to norm gains (1-D parameters) too",
             "(decay if param.dim() >= 2 else no_decay).append(param)",
             "(decay if param.dim() >= 1 else no_decay).append(param)",
             ("tests/test_schedule.py::test_weight_decay_shrinks_the_matrices_and_leaves_the_norm_gains",)),
    # ---- data ----
    Mutation("data-ranks-same-block", f"{SRC}/data/loader.py",
             "every dp rank reads the same block of each micro-batch step",
             "begin = self.consumed + self.dp_rank * self.micro_batch_size", "begin = self.consumed",
             ("tests/test_loader.py::test_two_ranks_are_disjoint_and_together_equal_one_rank",)),
    Mutation("data-position-per-rank", f"{SRC}/data/loader.py",
             "the data position counts this rank's sequences only, not every rank's",
             "self.consumed += self.micro_batch_size * self.dp_world", "self.consumed += self.micro_batch_size",
             ("tests/test_loader.py::test_the_position_is_global_so_any_layout_resumes_with_every_sequence_once",)),
    Mutation("replicas-no-rewind", f"{SRC}/parallel/replicas.py",
             "a step torchft did not commit keeps the data it read",
             "self.loader.load_state_dict(self.before)", "pass",
             ("tests/distributed/test_dist_replicas.py::"
              "test_kill_9_of_a_replica_group_the_other_goes_on_and_it_heals_and_rejoins",)),
    Mutation("data-mixture-ranks-same-block", f"{SRC}/data/mixture.py",
             "a mixture: every dp rank keeps rank 0's sequences",
             "if rank == self.dp_rank:", "if rank == 0:",
             ("tests/data/test_mixture.py::test_ranks_split_the_one_rank_stream",)),
    # ---- fine-tuning: chat loss mask, document masking, LoRA ----
    Mutation("chat-mask-prompt", f"{SRC}/data/chat.py",
             "chat data: the prompt before each answer counts in the loss too",
             "take(render(messages[:i], tokenizer, add_generation_prompt=True), False)",
             "take(render(messages[:i], tokenizer, add_generation_prompt=True), True)",
             ("tests/data/test_chat_data.py::test_the_mask_covers_exactly_the_assistant_turns",)),
    Mutation("doc-positions-not-restarted", f"{SRC}/models/llama/model.py",
             "document masking: positions run on across packed documents",
             "    return rows - first[:, rows]",
             "    return rows.expand_as(first[:, rows])",
             ("tests/test_document_masking.py",)),
    Mutation("lora-base-trains", f"{SRC}/models/lora.py",
             "LoRA: the base weights are left trainable (and get optimizer state)",
             "        param.requires_grad_(is_adapter(name))", "        param.requires_grad_(True)",
             ("tests/test_lora.py::test_the_adapted_model_starts_as_the_model_and_only_adapters_train",)),
    Mutation("lora-tp-adapters-split-by-the-style", f"{SRC}/parallel/tensor.py",
             "LoRA under tp: the adapters left to the layer's style (A split along its rank under ColwiseParallel)",
             "for layer in module.modules() if ADAPTERS[0] in layer._parameters}",
             "for layer in module.modules() if False}",
             ("tests/test_lora.py::test_tensor_parallel_splits_each_adapter_as_its_layer",
              "tests/distributed/test_dist_chat_lora.py")),
    Mutation("tp-sp-thaws-frozen-norms", f"{SRC}/parallel/tensor.py",
             "sequence parallel makes the frozen norms' weights trainable (LoRA trains them)",
             "        param.requires_grad_(name not in frozen)", "        pass",
             ("tests/test_lora.py::test_tensor_parallel_splits_each_adapter_as_its_layer",
              "tests/distributed/test_dist_chat_lora.py")),
    Mutation("pp-tied-grads-of-a-frozen-table", f"{SRC}/parallel/pipeline.py",
             "pipeline: the tied-gradient sum reaches for a frozen table's gradients (LoRA: there are none)",
             "                     if name in params and params[name].requires_grad]",
             "                     if name in params]",
             ("tests/distributed/test_dist_chat_lora.py",)),
    # ---- checkpoints ----
    Mutation("ckpt-hash-first-chunk", f"{SRC}/checkpoint/verify.py",
             "checkpoint verification hashes only the first 8 MiB chunk of each file",
             "while chunk := fh.read(CHUNK):", "if chunk := fh.read(CHUNK):",
             ("tests/test_resilience.py::test_damage_past_the_first_hashing_chunk_is_found_and_named",)),
    # ---- data parallel ----
    Mutation("dp-sync-wrong-micro-batch", f"{SRC}/parallel/data.py",
             "DDP/FSDP gradient sync on every micro-batch but the last (no_sync inverted)",
             "        if last or self.dims.zero == 3:\n            return contextlib.nullcontext()",
             "        if not last or self.dims.zero == 3:\n            return contextlib.nullcontext()",
             (f"{EQ}::test_two_rank_layouts_equal_one_process[dp2-zero0-fp32]",)),
    Mutation("dp-loss-average", f"{SRC}/parallel/data.py",
             "the training loss summed over the dp ranks, not averaged",
             "return self.sum_over_data(value) / self.dims.dp if training else value",
             "return self.sum_over_data(value) if training else value",
             (f"{EQ}::test_two_rank_layouts_equal_one_process[dp2-zero0-fp32]",)),
    Mutation("dp-hsdp-replicas-not-averaged", f"{SRC}/parallel/dims.py",
             "HSDP: data parallelism over the shard group only (replica groups never average)",
             'return self.submesh("dp_replicate", "dp_shard")', 'return self.submesh("dp_shard")',
             (f"{EQ}::test_four_rank_layouts_equal_one_process[hsdp2x2-fp32]",)),
    # ---- tensor parallel ----
    Mutation("tp-loss-parallel-off", f"{SRC}/parallel/tensor.py",
             "tensor parallel: the loss not computed under loss_parallel",
             "            with loss_parallel():", "            with contextlib.nullcontext():",
             (f"{EQ}::test_two_rank_layouts_equal_one_process[tp2-fp32]",)),
    # ---- pipeline ----
    Mutation("pp-documents-not-handed", f"{SRC}/parallel/pipeline.py",
             "pipeline: the stages run without the micro-batch's documents (no document mask)",
             "target=targets if self.pipeline.holds_last else None, **documents)",
             "target=targets if self.pipeline.holds_last else None)",
             (CHAT,)),
    Mutation("pp-loss-wrong-micro-batches", f"{SRC}/parallel/pipeline.py",
             "pipeline loss averaged over the first n losses (the first step's shape-inference one included)",
             "torch.stack(self._losses[-n:])", "torch.stack(self._losses[:n])",
             (PP_1F1B, f"{PIPE}::test_pp2_with_each_schedule_equals_one_process[pp2-1f1b-bf16]")),
    Mutation("pp-grads-not-scaled", f"{SRC}/parallel/pipeline.py",
             "pipeline gradients not divided by the micro-batch count",
             "loss_fn=loss_fn, scale_grads=True)", "loss_fn=loss_fn, scale_grads=False)",
             (PP_1F1B,)),
    Mutation("pp-tied-grads-not-summed", f"{SRC}/parallel/pipeline.py",
             "pipeline: the tied embedding's two copies do not add their gradients",
             "            dist.all_reduce(grads[0], group=self.group)", "            pass",
             (PP_1F1B,)),
    # ---- context parallel ----
    Mutation("cp-doc-block-lse", f"{SRC}/models/attention.py",
             "document masking under cp: a block row that sees no key keeps the kernel's lse 0, not -inf",
             '        lse = lse.masked_fill(~mask.any(-1), float("-inf"))', "        pass",
             ("tests/test_document_masking.py::test_context_parallel_blocks_skip_a_row_that_sees_no_key",
              f"{CP}::test_context_parallel_attention_equals_full_causal_attention")),
    Mutation("cp-loss-weight", f"{SRC}/parallel/context.py",
             "cp: each shard's mean loss counts alike, however many of its targets count",
             "        return self.cp * (mine != IGNORE).sum() / (whole != IGNORE).sum().clamp(min=1)",
             "        return torch.ones((), device=mine.device)",
             (CHAT,)),
    Mutation("cp-loss-average", f"{SRC}/parallel/context.py",
             "loss summed over the cp ranks, not averaged",
             "        return self.sum_over_data(value) / self.cp", "        return self.sum_over_data(value)",
             (f"{CPEP}::test_two_rank_cp_and_ep_equal_one_process[cp2]",)),
    Mutation("cp-shard-positions", f"{SRC}/parallel/context.py",
             "context parallel: RoPE positions of a rank's second chunk not zig-zagged",
             "second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)",
             "second = torch.arange((cp + rank) * c, (cp + rank + 1) * c, device=device)",
             (f"{CPEP}::test_two_rank_cp_and_ep_equal_one_process[cp2]",)),
    Mutation("cp-val-loss-average", f"{SRC}/training/step.py",
             "validation: the loss not averaged over the ranks (each rank's own shard's)",
             "        return float(self.axes.average_loss(loss, training=False))", "        return float(loss)",
             (f"{CPEP}::test_two_rank_cp_and_ep_equal_one_process[cp2]",)),
    # ---- expert parallel ----
    Mutation("ep-grads-wrong-group", f"{SRC}/parallel/expert.py",
             "expert gradients summed over the ep group (other experts) instead of their replicas",
             "groups = [self.dims.mesh[name].get_group() for name in self.dims.expert_replica_dims]",
             "groups = [self.dims.ep_mesh.get_group()]",
             (f"{CPEP}::test_two_rank_cp_and_ep_equal_one_process[ep2]",)),
    Mutation("ep-grads-divided-by-ep", f"{SRC}/parallel/expert.py",
             "expert gradients divided by ep instead of dp × cp",
             "grad.div_(self.dims.data_parallel)", "grad.div_(self.dims.ep)",
             (f"{CPEP}::test_four_rank_cp_and_ep_layouts_equal_one_process[ep2xdp2]",)),
    Mutation("ep-grads-divided-without-cp", f"{SRC}/parallel/expert.py",
             "expert gradients divided by dp, forgetting cp",
             "grad.div_(self.dims.data_parallel)", "grad.div_(self.dims.dp)",
             (f"{CPEP}::test_dp2_cp2_tp2_on_eight_ranks_equals_one_process[dp2xcp2xtp2-ep2]",)),
    # ---- data on an object store (issue 46) ----
    Mutation("shard-hash-unchecked", f"{SRC}/data/shards.py",
             "a fetched shard's sha256 not compared with meta.json's",
             "    if expected is not None and (actual := sha256_file(path)) != expected:",
             "    if expected is None and (actual := sha256_file(path)) != expected:",
             (f"{REMOTE}::test_a_flipped_byte_in_a_remote_shard_is_refused_naming_it",)),
    Mutation("cache-one-over", f"{SRC}/data/remote.py",
             "the shard cache evicts only once it holds more than data.cache_limit shards",
             "        while len(self.cached) >= self.limit:", "        while len(self.cached) > self.limit:",
             (f"{REMOTE}::test_two_epochs_through_a_cache_of_four_shards",)),
    Mutation("window-wrong-shards", f"{SRC}/data/order.py",
             "every window of an epoch ordered over the first window's shards",
             "for s in self.window_shards(epoch, w)])", "for s in self.window_shards(epoch, 0)])",
             (f"{REMOTE}::test_windowed_order_is_a_permutation_per_epoch_within_windows",)),
    Mutation("window-cache-any-epoch", f"{SRC}/data/order.py",
             "the window order of the last call reused in the next epoch",
             "if last[0] == epoch and last[1] <= offsets[0]", "if last[1] <= offsets[0]",
             (f"{REMOTE}::test_windowed_order_is_a_permutation_per_epoch_within_windows",)),
    Mutation("ray-ship-output-lost", f"{SRC}/curation/executors.py",
             "the files a shipped Ray task wrote not written back by the driver",
             "                write_bytes(Path(root) / rel, data)\n", "",
             ("tests/data/test_curation_s3.py::test_ray_without_a_shared_file_system_matches_the_local_run",)),
    Mutation("publish-meta-early", f"{SRC}/curation/publish.py",
             "a shard set's meta.json published before its shards",
             "else 1 if base == META else 0", "else -1 if base == META else 0",
             ("tests/data/test_curation_s3.py",)),
    Mutation("read-gz-raw", f"{SRC}/curation/stages/read.py",
             "a .jsonl.gz input read without decompressing it",
             "yield from _iter_jsonl(_decompressed(fh, rel), rel, cfg,", "yield from _iter_jsonl(fh, rel, cfg,",
             ("tests/data/test_curation_s3.py::test_curate_from_s3_to_s3_reads_every_format_like_local_disk",)),
    # ---- decontamination, PII, code and numbers (issue 46, parts 4-6) ----
    Mutation("decont-case-kept", f"{SRC}/curation/contamination.py",
             "decontamination n-grams not lowercased",
             "return _WORD.findall(text.lower())", "return _WORD.findall(text)",
             ("tests/data/test_curation_decontaminate.py",)),
    Mutation("decont-unspaced-whitespace", f"{SRC}/curation/contamination.py",
             "whitespace inside a run of Chinese text kept when segmenting it",
             'joined = _SPACE.sub("", run)', "joined = run",
             ("tests/data/test_curation_decontaminate.py",)),
    Mutation("decont-cut-short", f"{SRC}/curation/contamination.py",
             "a cut span ends one word before the matching n-gram's last",
             "spans[s + n - 1][1]", "spans[s + n - 2][1]",
             ("tests/data/test_curation_decontaminate.py",)),
    Mutation("prefix-version-not-bumped", f"{SRC}/inference/prefix_cache.py",
             "a new block leaves the prefix cache's version: a waiting prompt keeps its stale lookup",
             "        self.blocks[key] = block\n        self.version += 1\n", "        self.blocks[key] = block\n",
             ("tests/evaluation/test_serve_prefix_cache.py",)),
    Mutation("prefill-error-as-refusal", f"{SRC}/serving/batcher.py",
             "a ValueError from a prefill forward is taken for a refused prompt: the queue keeps prompts in doubt",
             "except Refused as err:", "except ValueError as err:", ("tests/evaluation/test_serve_continuous.py",)),
    Mutation("endpoint-stops-cut-to-four", f"{SRC}/evaluation/backends.py",
             "an endpoint's generation is not cut at the stop strings past OpenAI's 4: a 5th runs on",
             'return cut_at_stop(r["choices"][0]["text"], stops)', 'return r["choices"][0]["text"]',
             ("tests/evaluation/test_api_client.py",)),
    Mutation("preempt-last-row", f"{SRC}/inference/engine.py",
             "the pool runs short and the last row gives way, an older request than the newest",
             "newest = max(range(len(self.rows)), key=lambda i: self.rows[i].order)", "newest = len(self.rows) - 1",
             ("tests/evaluation/test_serve_paged_kv.py",)),
    Mutation("pack-fork-at-first-difference", f"{SRC}/inference/engine.py",
             "a prompt packed behind another forks at their first difference: its first own token is scored "
             "from the other's position, as if it were the other's token",
             "            f = lead.shares(item) - 1\n", "            f = lead.shares(item)\n",
             ("tests/evaluation/test_serve_prefix_cache.py",)),
    Mutation("pack-copy-short", f"{SRC}/inference/prefill.py",
             "a packed prompt's shared keys and values are copied into its blocks one position short: its "
             "decode steps read a stale key",
             "self.slot, 0, self.fork)", "self.slot, 0, self.fork - 1)",
             ("tests/evaluation/test_serve_prefix_cache.py",)),
    Mutation("tree-mask-sees-fork-key", f"{SRC}/models/masks.py",
             "a packed branch also sees the trunk's key at its fork, which it computes itself: that key counts twice",
             "same = same | (k < spec.shared", "same = same | (k <= spec.shared",
             ("tests/test_attention.py", "tests/evaluation/test_serve_prefix_cache.py")),
    Mutation("prompt-tops-one-early", f"{SRC}/inference/sequence.py",
             "an echoed prompt token's top alternatives are the previous position's: greedy checks and "
             "acc of a scoring client read the wrong distribution",
             "zip(top_ids[1:].tolist(), top_values[1:].tolist()", "zip(top_ids[:-1].tolist(), top_values[:-1].tolist()",
             ("tests/evaluation/test_prompt_tokens.py", "tests/evaluation/test_serve_openai.py")),
    Mutation("paged-copy-source-is-destination", f"{SRC}/inference/paged_kv.py",
             "the followers' shared keys are gathered from their own (empty) blocks instead of the leader's",
             "for src, _, a, b in spans])", "for _, src, a, b in spans])",
             ("tests/evaluation/test_serve_prefix_cache.py",)),
    Mutation("eval-client-imports-training-config", f"{SRC}/config/inference.py",
             "the evaluation client's settings come from the training config again: every `eval --endpoint` "
             "imports its model presets and layout rules",
             "from ultratron.config.endpoint import EndpointConfig",
             "from ultratron.config.training import EndpointConfig",
             ("tests/evaluation/test_eval_endpoint.py",)),
    Mutation("json-loads-no-fallback", f"{SRC}/evaluation/api_client.py",
             "an answer with the NaN or -Infinity some servers write fails the evaluation instead of parsing",
             "    except orjson.JSONDecodeError:\n        return json.loads(body)\n",
             "    except orjson.JSONDecodeError:\n        raise\n", ("tests/evaluation/test_api_client.py",)),
    Mutation("task-cache-ignores-documents", f"{SRC}/evaluation/builtin.py",
             "the kept built-in task's key leaves the documents out: a changed corpus reads a stale task",
             'key.update(f"{len(doc_id)}:{doc_id}{len(text)}:".encode() + text.encode("utf-8", "surrogatepass"))',
             "pass", ("tests/evaluation/test_task_cache.py",)),
    Mutation("suite-fixed-fraction", f"{SRC}/evaluation/builtin.py",
             "the built-in suite's split fixed at 0.05 whatever the run held out",
             "    return checked_fraction(cfg.data.held_out_fraction)\n", "    return HELD_OUT_FRACTION\n",
             ("tests/evaluation/test_eval_held_out.py",)),
    Mutation("pii-private-ip", f"{SRC}/curation/stages/pii.py",
             "private and reserved IP addresses replaced too",
             "return ip.is_global and not (ip.is_private or", "return not (",
             ("tests/data/test_curation_pii.py",)),
    Mutation("pii-date-phone", f"{SRC}/curation/stages/pii.py",
             "a date followed by a time taken for a phone number",
             " or digits < 9 or _holds_date(groups)):", " or digits < 9):",
             ("tests/data/test_curation_pii.py",)),
    Mutation("digits-four", f"{SRC}/data/fast_bpe.py",
             "numbers in groups of four digits",
             "\\p{L}+|\\p{N}{1,3}|", "\\p{L}+|\\p{N}{1,4}|",
             ("tests/test_tokenizer_digits.py",)),
    Mutation("normalize-code-collapsed", f"{SRC}/curation/stages/normalize.py",
             "runs of spaces collapsed inside a Markdown fence",
             "pieces.append(fence.group())", "pieces.append(_SPACED_LINE.sub(_collapse_prose_line, fence.group()))",
             ("tests/data/test_curation_normalize_code.py",)),
    # ---- the CUDA/NCCL paths, each checked on a CPU (issue 45, part 3) ----
    Mutation("nccl-no-device-id", f"{SRC}/parallel/dims.py",
             "init_process_group under NCCL without device_id",
             'return {"backend": "nccl", "device_id": device}', 'return {"backend": "nccl"}',
             ("tests/test_nccl_setup.py",)),
    Mutation("destroy-after-failure", f"{SRC}/parallel/faults.py",
             "process groups destroyed, not aborted, after a failure",
             "target=dist.distributed_c10d._abort_process_group,", "target=dist.destroy_process_group,",
             ("tests/test_nccl_setup.py::test_leaving_after_a_failure_aborts_the_groups",)),
    Mutation("doctor-skips-nccl-dumps", f"{SRC}/parallel/hangs.py",
             "ultratron doctor does not read the NCCL watchdog's dumps",
             'glob(f"{NCCL_DUMP_PREFIX}*")', 'glob(f"{NCCL_DUMP_PREFIX}*.json")',
             ("tests/test_nccl_setup.py::test_doctor_reads_the_nccl_watchdogs_dump",)),
    Mutation("rng-every-gpu", f"{SRC}/training/state.py",
             "the RNG state of every visible GPU saved, not this process's",
             'state["cuda"] = torch.cuda.get_rng_state()', 'state["cuda"] = torch.cuda.get_rng_state_all()',
             ("tests/test_cuda_rng_state.py",)),
    Mutation("nvml-by-ordinal", f"{SRC}/training/health.py",
             "the health check's NVML device taken at the CUDA ordinal",
             "index = self.nvml_index_of(cuda_device, count)", "index = cuda_device",
             ("tests/test_health_gpu_index.py",)),
    Mutation("recompute-no-cudnn", f"{SRC}/parallel/recompute.py",
             "selective recompute does not save cuDNN attention",
             '    "aten._scaled_dot_product_cudnn_attention.default",', "",
             ("tests/test_recompute_ops.py",)),
    Mutation("precision-fp32-default", f"{SRC}/config/precision.py",
             "training.precision auto means fp32 on a GPU too",
             'return "bf16" if device_type == "cuda" else "fp32"', 'return "fp32"',
             ("tests/test_precision_defaults.py",)),
    Mutation("no-tf32", f"{SRC}/training/precision.py",
             "fp32 matmuls on a GPU without TF32",
             'torch.set_float32_matmul_precision("high")', 'torch.set_float32_matmul_precision("highest")',
             ("tests/test_precision_defaults.py::test_tf32_for_fp32_matmuls_on_a_gpu_only",)),
    Mutation("batch-not-pinned", f"{SRC}/parallel/axis.py",
             "a batch copied to a GPU from pageable memory",
             "        tensor = tensor.pin_memory()\n", "        pass\n",
             ("tests/test_batch_transfer.py",)),
    Mutation("offload-buffers-per-tensor", f"{SRC}/parallel/offload.py",
             "offload allocates a host buffer per tensor",
             "        kept = self.free.get(nbytes)", "        kept = None",
             ("tests/test_offload.py::test_host_buffers_are_reused_across_steps_not_allocated_per_tensor",)),
    Mutation("offload-no-prefetch", f"{SRC}/parallel/offload.py",
             "backward does not fetch the previous block ahead",
             "            if before is not None and not before.fetched:", "            if False:",
             ("tests/test_offload.py::test_backward_fetches_each_block_once_the_previous_one_ahead",)),
    Mutation("moe-host-read", f"{SRC}/models/moe.py",
             "every MoE layer reads its counts to the host",
             "    return order // choice.shape[1], order, count_slots(flat, n_experts)",
             "    counts_on_host(count_slots(flat, n_experts), 0)\n"
             "    return order // choice.shape[1], order, count_slots(flat, n_experts)",
             ("tests/test_moe_host_reads.py::test_a_step_of_an_moe_model_reads_nothing_to_the_host",)),
    # ---- serving's prefix cache (issue 47, parts 1 and 3) ----
    Mutation("prefix-key-no-parent", f"{SRC}/inference/prefix_cache.py",
             "a cached block is found by its tokens alone, whatever prefix came before them",
             "            parent, i = b.id, i + size", "            parent, i = ROOT, i + size",
             ("tests/evaluation/test_serve_prefix_cache.py::test_random_workload_matches_no_cache_and_stays_within_budget",)),
    Mutation("prefix-reuse-last", f"{SRC}/inference/prefill.py",
             "the last cached position is copied, not computed again, so its distribution is missing",
             "        self.reuse = min(cached, len(self.ids)) - 1 if cached else 0",
             "        self.reuse = min(cached, len(self.ids) - 1) if cached else 0",
             ("tests/evaluation/test_serve_prefix_cache.py::test_random_workload_matches_no_cache_and_stays_within_budget",)),
    Mutation("prefix-evict-bytes", f"{SRC}/inference/prefix_cache.py",
             "an evicted block's bytes are not given back to the budget",
             "        self.bytes -= self.nbytes(b)", "        self.bytes -= 0",
             ("tests/evaluation/test_serve_prefix_cache.py::test_random_workload_matches_no_cache_and_stays_within_budget",)),
    # ---- host memory of ZeRO-3 on a CPU (issue 44, the LoRA start) ----
    Mutation("prefetch-on-under-gloo", f"{SRC}/parallel/data.py",
             "FSDP2's backward prefetch left on under gloo: a second gathered block in backward",
             '    return dist.get_backend() != "gloo"', '    return True',
             ("tests/test_fsdp_prefetch.py",)),
    Mutation("plan-two-blocks-on-cpu", f"{SRC}/planning/memory.py",
             "plan memory counts two gathered ZeRO-3 blocks where each linear layer is a unit",
             'if layout.zero3_units == "linear":', "if False:",
             ("tests/planning/test_start_memory.py",)),
    Mutation("per-linear-every-block", f"{SRC}/planning/rules.py",
             "ZeRO-3 on a CPU splits blocks of any size into per-linear units (collectives for nothing)",
             "return block_bytes >= PER_LINEAR_FROM_BYTES", "return True",
             ("tests/test_fsdp_prefetch.py", "tests/planning/test_start_memory.py")),
    Mutation("mallopt-wrong-param", f"{SRC}/training/allocator.py",
             "mallopt given another parameter than M_MMAP_THRESHOLD: the threshold stays dynamic",
             "M_MMAP_THRESHOLD = -3  #", "M_MMAP_THRESHOLD = -1  #",
             ("tests/test_host_allocator.py",)),
    Mutation("mallopt-on-gpu", f"{SRC}/training/allocator.py",
             "the mmap threshold set for a GPU run too",
             'if device.type != "cpu" or', 'if device.type == "meta" or',
             ("tests/test_host_allocator.py",)),
]
BY_ID = {m.id: m for m in MUTATIONS}
assert len(BY_ID) == len(MUTATIONS), "mutation ids must be unique"


@dataclass
class Result:
    id: str
    status: str  # caught | MISSED | timeout | stale | error | skipped
    failed: list[str] = field(default_factory=list)  # node ids that failed an assertion
    errored: list[str] = field(default_factory=list)  # node ids that errored (e.g. a rank crashed in a fixture)
    counts: dict[str, int] = field(default_factory=dict)  # pytest's summary: passed, failed, error, skipped
    seconds: float = 0.0
    detail: str = ""  # why, for stale / error / timeout; the output's tail otherwise

    def outcome(self) -> str:
        if self.status != "caught":
            return self.status
        ran = sum(self.counts.get(k, 0) for k in ("passed", "failed", "error"))
        bad = self.counts.get("failed", 0) + self.counts.get("error", 0)
        which = [_names(self.failed)] if self.failed else []
        which += [f"{_names(self.errored)} (errored)"] if self.errored else []
        return f"caught by {'; '.join(which) or '?'}" + (f" ({bad}/{ran} failed)" if ran > 1 else "")


def _short(node: str) -> str:
    return node.split("::", 1)[-1] if "::" in node else Path(node).name


def _names(nodes: list[str]) -> str:
    """Test names, the parameters of one test function together: test_x[a,b], test_y."""
    params: dict[str, list[str]] = {}
    for node in nodes:
        name, _, param = _short(node).partition("[")
        params.setdefault(name, []).append(param.rstrip("]"))
    return ", ".join(name + (f"[{','.join(p for p in ps if p)}]" if any(ps) else "") for name, ps in params.items())


def is_distributed(m: Mutation) -> bool:
    return any(t.startswith("tests/distributed/") for t in m.tests)


# ---- the temporary copy ---------------------------------------------------------------------------

def _repository_files(root: Path) -> list[str]:
    """Tracked files and untracked ones git does not ignore (so uncommitted work is tested too)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, check=True).stdout
        return [name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: the directories that matter
        names = []
        for top in ("src", "tests", "benchmarks", "configs", "docs"):
            names += [str(p.relative_to(root)) for p in (root / top).rglob("*")
                      if p.is_file() and "__pycache__" not in p.parts]
        return names + [n for n in ("pyproject.toml", "README.md", "Makefile") if (root / n).is_file()]


def make_copy(root: Path, files: list[str]) -> Path:
    dest = Path(tempfile.mkdtemp(prefix="ultratron-mutant-"))
    for name in files:
        source = root / name
        if source.is_file():  # (a tracked file deleted in the work tree is skipped)
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


class Stale(Exception):
    pass


def apply(mutation: Mutation, root: Path) -> None:
    """Make the mutation's edit in the tree at `root`; Stale if its old string is not there exactly once."""
    path = root / mutation.path
    if not path.is_file():
        raise Stale(f"{mutation.path} does not exist")
    text = path.read_text(encoding="utf-8")
    count = text.count(mutation.old)
    if count != 1:
        raise Stale(f"{mutation.path}: the old string occurs {count} times, not once: {mutation.old!r}")
    path.write_text(text.replace(mutation.old, mutation.new), encoding="utf-8")


def check(root: Path = ROOT) -> list[str]:
    """Problems with the list against the tree at `root`: edits that do not apply exactly once, edits
    that change nothing, guarding tests whose file or test function does not exist."""
    problems = []
    for m in MUTATIONS:
        path = root / m.path
        count = path.read_text(encoding="utf-8").count(m.old) if path.is_file() else -1
        if count != 1:
            problems.append(f"{m.id}: {m.path}: old string found {count} times (want 1)")
        if m.old == m.new:
            problems.append(f"{m.id}: the edit changes nothing")
        for test in m.tests:
            file, _, rest = test.partition("::")
            if not (root / file).is_file():
                problems.append(f"{m.id}: {file} does not exist")
            elif rest and f"def {rest.split('[')[0]}(" not in (root / file).read_text(encoding="utf-8"):
                problems.append(f"{m.id}: {file} has no test {rest.split('[')[0]}")
    return problems


def _environment(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    # the copy's src first: it wins over the editable install and any PYTHONPATH given to this script
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(copy / "src"), env.get("PYTHONPATH", "")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _imports_the_copy(python: str, copy: Path, env: dict[str, str]) -> str | None:
    """None if `python` imports ultratron from the copy; else where it imports it from."""
    out = subprocess.run([python, "-c", "import ultratron; print(ultratron.__file__)"], cwd=copy, env=env,
                         capture_output=True, text=True, timeout=120)
    where = out.stdout.strip()
    return None if out.returncode == 0 and Path(where).resolve().is_relative_to(copy.resolve()) else (
        where or out.stderr.strip()[-500:])


# ---- one run -------------------------------------------------------------------------------------

_RUNNING: dict[int, subprocess.Popen] = {}  # the pytest processes this script started, by pid


def _pytest(python: str, copy: Path, tests: list[str], timeout: float, first_failure: bool,
            log: Path | None) -> tuple[int | None, str]:
    """Run pytest on `tests` in the copy; (exit code or None on timeout, output)."""
    cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", f"--basetemp={copy / '.pytest-tmp'}",
           *(["-x"] if first_failure else []), *tests]
    # a session of its own, so that a timeout or Ctrl-C ends the spawned ranks with pytest
    proc = subprocess.Popen(cmd, cwd=copy, env=_environment(copy), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    _RUNNING[proc.pid] = proc
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, _ = proc.communicate()
        code = None
    finally:
        _RUNNING.pop(proc.pid, None)
    if log is not None:
        log.write_text(out, encoding="utf-8")
    return code, out


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this script started for that pytest
    except ProcessLookupError:
        pass


def _summary(out: str) -> tuple[list[str], list[str], dict[str, int]]:
    """(failed node ids, errored node ids, pytest's counts) from the -rfE summary."""
    found = {kind: [m.group(1) for m in re.finditer(rf"^{kind} (\S+)", out, re.MULTILINE)]
             for kind in ("FAILED", "ERROR")}
    lines = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", line)]
    counts: dict[str, int] = {}
    if lines:
        for number, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped)", lines[-1]):
            counts[kind.rstrip("s") if kind.startswith("error") else kind] = int(number)
    return list(dict.fromkeys(found["FAILED"])), list(dict.fromkeys(found["ERROR"])), counts


def classify(code: int | None, out: str) -> str:
    """The outcome from pytest's exit code (None: timed out)."""
    _, _, counts = _summary(out)
    if code is None:
        return "timeout"
    if code == 0:
        return "skipped" if counts.get("passed", 0) == 0 and counts.get("skipped", 0) else "MISSED"
    if code == 1:  # some test failed or errored (a rank that crashed shows as an error in its fixture)
        return "caught"
    return "error"  # 2 interrupted / collection error, 3 internal, 4 usage, 5 no tests


def run_one(mutation: Mutation | None, files: list[str], args) -> Result:
    """Copy the repository, plant `mutation` (None: the baseline), run its tests, remove the copy."""
    tests = list(mutation.tests) if mutation else sorted({t for m in args.selected for t in m.tests})
    name = mutation.id if mutation else "baseline"
    copy = make_copy(ROOT, files)
    start = time.perf_counter()
    try:
        if mutation is not None:
            try:
                apply(mutation, copy)
            except Stale as err:
                return Result(name, "stale", detail=str(err))
        env = _environment(copy)
        if (where := _imports_the_copy(args.python, copy, env)) is not None:
            return Result(name, "error", detail=f"the copy's ultratron is not the one imported: {where}")
        log = Path(args.logs) / f"{name}.log" if args.logs else None
        code, out = _pytest(args.python, copy, tests, args.timeout, args.first_failure, log)
        failed, errored, counts = _summary(out)
        tail = "\n".join(out.strip().splitlines()[-15:])
        return Result(name, classify(code, out), failed, errored, counts, round(time.perf_counter() - start, 1),
                      tail)
    finally:
        shutil.rmtree(copy, ignore_errors=True)


# ---- the table -----------------------------------------------------------------------------------

def print_list(mutations: list[Mutation]) -> None:
    for m in mutations:
        print(f"{m.id}  [{m.path.removeprefix(SRC + '/')}]{'  (distributed)' if is_distributed(m) else ''}")
        print(f"    {m.description}")
        print(f"    - {m.old.strip()!r}\n    + {m.new.strip()!r}")
        for t in m.tests:
            print(f"    test: {t}")
        if m.note:
            print(f"    note: {m.note}")


def print_table(results: list[Result]) -> None:
    rows = [("id", "file", "description", "tests", "result", "s")]
    for r in results:
        m = BY_ID.get(r.id)
        tests = _names(list(m.tests)) if m else "(all guards)"
        rows.append((r.id, m.path.removeprefix(SRC + "/") if m else "", m.description if m else "", tests,
                     r.outcome(), f"{r.seconds:.0f}"))
    widths = [min(max(len(row[i]) for row in rows), cap) for i, cap in enumerate((32, 28, 50, 50, 100, 6))]

    def cut(text: str, width: int) -> str:
        return text if len(text) <= width else text[:width - 1] + "…"

    for i, row in enumerate(rows):
        print("  ".join(cut(cell, w).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    caught = sum(r.status == "caught" for r in results)
    missed = sum(r.status == "MISSED" for r in results)
    others = {s: sum(r.status == s for r in results) for s in ("timeout", "stale", "error", "skipped")}
    extra = "".join(f", {n} {s}" for s, n in others.items() if n)
    print(f"\n{caught} caught, {missed} missed{extra}")


def _read_results(path: Path) -> dict[str, Result]:
    done = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                done[record["id"]] = Result(**record)
    return done


def _terminate(signum, frame):  # SIGTERM: unwind like Ctrl-C, so the copies are removed
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the mutations, their edits and tests; run nothing")
    parser.add_argument("--check", action="store_true",
                        help="check that every edit applies exactly once and every test exists; run nothing")
    parser.add_argument("--only", default="", help="comma-separated mutation ids to run (default: all)")
    parser.add_argument("--single-process", action="store_true",
                        help="only the mutations whose guarding tests run in one process (not tests/distributed)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per mutation's test run (default 3600)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="mutations run at once, each in its own copy (default 1; the distributed tests "
                             "already use several processes)")
    parser.add_argument("--first-failure", action="store_true", help="stop a mutation's tests at the first failure")
    parser.add_argument("--baseline", action="store_true",
                        help="first run the selected mutations' tests with no mutation; stop if any fails")
    parser.add_argument("--results", default="", help="append each result to this JSON-lines file")
    parser.add_argument("--resume", action="store_true", help="skip the mutations already recorded in --results")
    parser.add_argument("--logs", default="", help="write each run's full pytest output to DIR/ID.log")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest")
    args = parser.parse_args(argv)

    if args.only:
        unknown = [i for i in args.only.split(",") if i not in BY_ID]
        if unknown:
            parser.error(f"unknown mutation id(s): {', '.join(unknown)}; see --list")
        selected = [BY_ID[i] for i in args.only.split(",")]
    else:
        selected = list(MUTATIONS)
    if args.single_process:
        selected = [m for m in selected if not is_distributed(m)]
    if args.list:
        print_list(selected)
        return 0
    if args.check:
        problems = check()
        print("\n".join(problems) if problems else f"all {len(MUTATIONS)} mutations apply exactly once")
        return 1 if problems else 0
    if args.resume and not args.results:
        parser.error("--resume needs --results FILE")
    args.selected = selected
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
    previous = _read_results(Path(args.results)) if args.results and args.resume else {}
    todo = [m for m in selected if m.id not in previous]

    signal.signal(signal.SIGTERM, _terminate)
    files = _repository_files(ROOT)
    results: dict[str, Result] = {m.id: previous[m.id] for m in selected if m.id in previous}
    pool = ThreadPoolExecutor(max_workers=max(1, args.jobs))
    try:
        if args.baseline and todo:
            print(f"baseline: the guarding tests of {len(todo)} mutation(s), unmutated ...", flush=True)
            base = run_one(None, files, argparse.Namespace(**{**vars(args), "selected": todo}))
            passed = base.status == "MISSED"  # (with no mutation planted: every test passed)
            print(f"baseline: {'passed' if passed else base.status} in {base.seconds:.0f} s {base.counts}", flush=True)
            if not passed:
                print("the guarding tests do not pass without a mutation; fix that first:\n" + base.detail)
                return 2
        print(f"{len(todo)} mutation(s) to run, {len(results)} already recorded", flush=True)
        pending = {pool.submit(run_one, m, files, args) for m in todo}
        while pending:  # (a timed wait, so that Ctrl-C and SIGTERM are handled at once)
            done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            for future in done:
                result = future.result()
                results[result.id] = result
                print(f"{result.id}: {result.outcome()} ({result.seconds:.0f} s)", flush=True)
                if args.results:
                    with open(args.results, "a", encoding="utf-8") as fh:
                        fh.write(json.dumps(asdict(result)) + "\n")
    except KeyboardInterrupt:
        # the running tests first (their threads then return and remove their copies), then the queue
        for proc in list(_RUNNING.values()):
            _kill(proc)
        pool.shutdown(wait=True, cancel_futures=True)
        print("\ninterrupted; the copies are removed, nothing was planted in this tree", file=sys.stderr)
        if not results:
            return 130
    pool.shutdown(wait=True)
    print()
    print_table([results[m.id] for m in selected if m.id in results])
    return 0


if __name__ == "__main__":
    sys.exit(main())
