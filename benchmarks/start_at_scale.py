"""Issue 44's CPU acceptance: how much memory each rank takes to *start* a model that no rank should
hold whole, under ZeRO-3 on 4 gloo processes. Prints figures and PASS/FAIL; not a test.

  python benchmarks/start_at_scale.py [--work runs/start_at_scale] [--fp32-gb 4.5 | --layers N]
                                      [--only tiny,lora]   (skip the ~20 GB scratch run)

1. Writes a synthetic Hugging Face Llama directory (config.json, model-0000i-of-0000n.safetensors
   shards with model.safetensors.index.json, a byte-level BPE tokenizer.json trained here on
   standard-library files, tokenizer_config.json) whose fp32 weights are about --fp32-gb GB
   (default 4.5: hidden 2048, intermediate 5632, 16 heads, 8 key/value heads, 24 layers, vocab
   4096, so the largest tensor is ~46 MB). Weights are random normal (std 0.02, fixed seed),
   norms ones, written a shard at a time: the whole model is never in memory. It is cached under
   WORK/hf-<shape> and reused by later runs.
2. `ultratron import hf --model HF --out WORK/import-<shape>` (fresh each run), its peak RSS measured.
3. Three runs of `torchrun --nproc-per-node 4 -m ultratron train` (gloo on CPU), each one step of one
   sequence per rank (seq 64, micro-batch 1, fp32, one thread per rank, no validation, no sample,
   no health check, a synchronous final save), dp 4, ZeRO-3:
     tiny     the tiny preset: the baseline (Python + torch + gloo + the data pipeline) per rank;
     lora     LoRA rank 8 on the import (model.init_from), the import's shape;
     scratch  the same shape from random initialization.
   Each rank writes RUN/memory/rank<r>.json: `max_rss_bytes` (its peak resident set over the run)
   and `start_max_rss_bytes` (its peak right after the model is materialized and initialized or
   loaded, before the first step). Where a trainer does not write the latter yet, `max_rss_bytes`
   stands in (marked "*" in the table).

Acceptance (each rank; "above baseline" = the figure minus the tiny run's same figure on the same rank):
  (a) lora:    exit 0, and max RSS above baseline <= 0.4 x the model's fp32 bytes;
  (b) scratch: exit 0, and start RSS above baseline <= 0.4 x the model's fp32 bytes.
Exit status 1 on any FAIL (2 when the baseline itself fails).

Memory: a trainer that builds the whole model on every rank before sharding it peaks at about
4 x (fp32 bytes) + 4 x baseline on this machine; at the default 4.5 GB that is ~20 GB. On a 24 GiB
machine that others share, measure such a trainer at a smaller --fp32-gb (e.g. 2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import tomllib
from pathlib import Path

RATIO_LIMIT = 0.4
RUNS = ("tiny", "lora", "scratch")
NPROC = 4
SEED = 0
STD = 0.02
SHARD_BYTES = 400 * 2**20  # ~ two layers of the default shape per file
# Standard-library modules, ~400 kB of Python: the tokenizer's training text and the runs' corpus.
CORPUS = ["argparse.py", "collections/__init__.py", "json/decoder.py", "json/encoder.py", "textwrap.py",
          "string.py", "heapq.py", "bisect.py", "functools.py", "shlex.py", "fractions.py", "statistics.py",
          "dataclasses.py", "enum.py", "pprint.py", "difflib.py", "csv.py", "glob.py", "fnmatch.py",
          "copy.py", "queue.py", "random.py", "calendar.py", "configparser.py"]


# ---- the synthetic Hugging Face model -------------------------------------------------------------

def hf_tensors(a: argparse.Namespace) -> list[tuple[str, list[int]]]:
    """(name, shape) of every tensor of transformers' LlamaForCausalLM of this shape, in file order."""
    head = a.dim // a.heads
    out = [("model.embed_tokens.weight", [a.vocab, a.dim])]
    for i in range(a.layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", [a.dim]),
                (p + "self_attn.q_proj.weight", [a.heads * head, a.dim]),
                (p + "self_attn.k_proj.weight", [a.kv_heads * head, a.dim]),
                (p + "self_attn.v_proj.weight", [a.kv_heads * head, a.dim]),
                (p + "self_attn.o_proj.weight", [a.dim, a.heads * head]),
                (p + "post_attention_layernorm.weight", [a.dim]),
                (p + "mlp.gate_proj.weight", [a.ffn, a.dim]),
                (p + "mlp.up_proj.weight", [a.ffn, a.dim]),
                (p + "mlp.down_proj.weight", [a.dim, a.ffn])]
    return out + [("model.norm.weight", [a.dim]), ("lm_head.weight", [a.vocab, a.dim])]


def fp32_bytes(a: argparse.Namespace) -> int:
    return 4 * sum(math.prod(shape) for _, shape in hf_tensors(a))


def layers_for(a: argparse.Namespace, gb: float) -> int:
    """The fewest layers whose fp32 weights reach `gb` × 1e9 bytes."""
    one = argparse.Namespace(**{**vars(a), "layers": 1})
    per_layer = fp32_bytes(argparse.Namespace(**{**vars(a), "layers": 2})) - fp32_bytes(one)
    rest = fp32_bytes(one) - per_layer
    return max(1, math.ceil((gb * 1e9 - rest) / per_layer))


def write_corpus(out: Path) -> Path:
    src = Path(sysconfig.get_paths()["stdlib"])
    if not out.is_dir():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name in CORPUS:
            shutil.copy(src / name, tmp / name.replace("/", "_"))
        tmp.rename(out)
    return out


def write_tokenizer(out: Path, corpus: Path, vocab: int) -> None:
    """A byte-level BPE of `vocab` entries or fewer, <s> and </s> its first two; the config names them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [p.read_text(encoding="utf-8") for p in sorted(corpus.glob("*.py"))]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))


def write_hf_model(out: Path, a: argparse.Namespace, corpus: Path) -> None:
    """The directory, streamed: a shard's tensors are made, written and dropped before the next shard's."""
    import torch
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = hf_tensors(a)
    shards, size = [[]], 0
    for name, shape in tensors:
        nbytes = 4 * math.prod(shape)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map = {}
    generator = torch.Generator().manual_seed(SEED)
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        part = {}
        for name, shape in shard:
            part[name] = torch.ones(shape) if name.endswith("norm.weight") else \
                torch.empty(shape).normal_(0.0, STD, generator=generator)
            weight_map[name] = file
        save_file(part, str(tmp / file), metadata={"format": "pt"})
        del part
        print(f"  wrote {file} ({len(shard)} tensors)", flush=True)
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": fp32_bytes(a)}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.dim,
        "intermediate_size": a.ffn, "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads, "head_dim": a.dim // a.heads, "vocab_size": a.vocab,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "initializer_range": STD,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32"}, indent=1))
    write_tokenizer(tmp, corpus, a.vocab)
    tmp.rename(out)


# ---- running and measuring ------------------------------------------------------------------------

def _rss_anon(pid: int) -> int | None:
    """The process's anonymous resident bytes now (its heap: not the file pages it has mapped)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_measured(cmd: list[str], log: Path) -> tuple[int, float, int, int]:
    """(exit status, wall seconds, peak RSS bytes of the process and its waited-for children, the
    largest anonymous RSS of the process itself seen by polling every 50 ms)."""
    print("$ " + " ".join(cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    anon = [0]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)

        def poll():
            while proc.returncode is None:
                anon[0] = max(anon[0], _rss_anon(proc.pid) or 0)
                time.sleep(0.05)

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        watcher.join()
    wall = time.perf_counter() - start
    if proc.returncode:
        print(f"  exit {proc.returncode}; the last lines of {log}:\n" +
              "\n".join(log.read_text(errors="replace").splitlines()[-15:]), flush=True)
    return proc.returncode, wall, usage.ru_maxrss * 1024, anon[0]


def shape_flags(import_dir: Path) -> list[str]:
    """--model.FIELD VALUE for every scalar field of the import's config.toml model section."""
    model = tomllib.loads((import_dir / "config.toml").read_text(encoding="utf-8"))["model"]
    flags = []
    for key, value in model.items():
        if key in ("init_from", "preset") or isinstance(value, dict | list):
            continue
        flags += [f"--model.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return flags


def memory_of(run: Path) -> dict[int, dict]:
    """rank → {max, start, start_measured}: RUN/memory/rank<r>.json (start falls back to max)."""
    out = {}
    for r in range(NPROC):
        path = run / "memory" / f"rank{r}.json"
        if not path.is_file():
            continue
        record = json.loads(path.read_text())
        start = record.get("start_max_rss_bytes")
        out[r] = {"max": record["max_rss_bytes"], "start": record["max_rss_bytes"] if start is None else start,
                  "start_measured": start is not None}
    return out


def gb(n: float) -> str:
    return f"{n / 1e9:6.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="runs/start_at_scale", help="where the model, import and runs go")
    parser.add_argument("--fp32-gb", type=float, default=4.5, help="the model's fp32 size in GB (1e9 bytes): "
                        "sets the layer count (default 4.5: 24 layers)")
    parser.add_argument("--layers", type=int, default=None, help="the layer count itself (overrides --fp32-gb)")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096, help="the tokenizer's and model's vocabulary")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (one sequence per rank)")
    parser.add_argument("--only", default="tiny,lora,scratch",
                        help="which runs, comma-separated, of tiny (always run: the baseline), lora, scratch; "
                             "a criterion whose run is left out is not judged")
    parser.add_argument("--shape-from-init", action="store_true",
                        help="the LoRA run names only model.init_from, no shape flags (once init_from takes "
                             "the shape from the checkpoint)")
    a = parser.parse_args(argv)
    if a.layers is None:
        a.layers = layers_for(a, a.fp32_gb)
    only = {name.strip() for name in a.only.split(",") if name.strip()}
    if only - set(RUNS):
        parser.error(f"--only: unknown run(s) {', '.join(sorted(only - set(RUNS)))}; choose from {', '.join(RUNS)}")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    size = fp32_bytes(a)
    key = f"L{a.layers}-d{a.dim}-f{a.ffn}-h{a.heads}-kv{a.kv_heads}-v{a.vocab}"
    print(f"model: {key}, {size / 4:,.0f} parameters, fp32 {size / 1e9:.2f} GB; limit {RATIO_LIMIT} x = "
          f"{RATIO_LIMIT * size / 1e9:.2f} GB per rank above the tiny baseline", flush=True)
    available = _mem_available()
    if available is not None and NPROC * size > 0.8 * available:
        print(f"note: {NPROC} whole fp32 copies ({NPROC * size / 1e9:.1f} GB) exceed 80% of the memory available "
              f"now ({available / 1e9:.1f} GB): a trainer that builds the whole model on each rank may run out",
              flush=True)
    walls: dict[str, float] = {}

    corpus = write_corpus(work / "corpus")
    hf = work / f"hf-{key}"
    if hf.is_dir():
        print(f"reusing {hf}")
    else:
        print(f"writing {hf}", flush=True)
        start = time.perf_counter()
        write_hf_model(hf, a, corpus)
        walls["write HF model"] = time.perf_counter() - start

    imported = work / f"import-{key}"
    shutil.rmtree(imported, ignore_errors=True)
    rc, walls["import"], import_rss, import_anon = run_measured(
        [sys.executable, "-m", "ultratron", "import", "hf", "--model", str(hf), "--out", str(imported)],
        work / "import.log")
    if rc:
        print("FAIL: the import failed")
        return 2
    print(f"import: peak RSS {import_rss / 1e9:.2f} GB = {import_rss / size:.2f} x fp32 (of it anonymous, "
          f"sampled: {import_anon / 1e9:.2f} GB = {import_anon / size:.2f} x; the rest is mapped file pages)",
          flush=True)

    tokenizer = imported / "checkpoints" / "step-0000000" / "tokenizer.json"
    common = ["--training.steps", "1", "--training.seq_len", str(a.seq), "--training.micro_batch_size", "1",
              "--training.batch_tokens", str(a.seq * NPROC), "--training.precision", "fp32",
              "--training.threads", "1", "--training.sample_tokens", "0", "--training.progress", "false",
              "--eval.interval", "0", "--health.check", "false", "--checkpoint.async_save", "false",
              "--run.tensorboard", "false", "--parallel.dp", str(NPROC), "--parallel.zero", "3",
              "--data.path", str(corpus), "--data.extensions", ".py", "--data.held_out_fraction", "0.1"]
    shape = shape_flags(imported)
    runs = {"tiny": ["--model.preset", "tiny", "--model.vocab_size", str(a.vocab), "--data.tokenizer", str(tokenizer)],
            "lora": ["--model.init_from", str(imported), "--lora.rank", "8",
                     *([] if a.shape_from_init else shape)],
            "scratch": [*shape, "--data.tokenizer", str(tokenizer)]}
    runs = {name: flags for name, flags in runs.items() if name == "tiny" or name in only}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC), "--standalone",
                "-m", "ultratron", "train"]
    codes, memory = {}, {}
    for name, flags in runs.items():
        run = work / f"run-{name}"
        shutil.rmtree(run, ignore_errors=True)
        codes[name], walls[name], _, _ = run_measured(torchrun + common + flags + ["--run.dir", str(run)],
                                                   work / f"{name}.log")
        memory[name] = memory_of(run)
        print(f"{name}: exit {codes[name]}, {walls[name]:.0f} s", flush=True)
        if name == "tiny" and (codes[name] or len(memory[name]) != NPROC):
            print("FAIL: the tiny baseline did not run")
            return 2

    base = memory["tiny"]
    print(f"\nper rank, GB (1e9 bytes); 'above' = minus the tiny run's same figure on the same rank; "
          f"ratio = above / fp32 {size / 1e9:.2f} GB; * = start_max_rss_bytes absent, max_rss_bytes stands in")
    print(f"{'run':8} {'rank':>4} {'max RSS':>8} {'above':>7} {'ratio':>6}   {'start RSS':>9} {'above':>7} "
          f"{'ratio':>6}")
    worst = {}
    for name in runs:
        for r in range(NPROC):
            m = memory[name].get(r)
            if m is None:
                print(f"{name:8} {r:>4}   (no memory record)")
                continue
            above_max, above_start = m["max"] - base[r]["max"], m["start"] - base[r]["start"]
            star = "" if m["start_measured"] and base[r]["start_measured"] else "*"
            print(f"{name:8} {r:>4} {gb(m['max']):>8} {gb(above_max):>7} {above_max / size:6.2f}   "
                  f"{gb(m['start']) + star:>9} {gb(above_start):>7} {above_start / size:6.2f}")
            if name != "tiny":
                worst[name, "max"] = max(worst.get((name, "max"), -math.inf), above_max / size)
                worst[name, "start"] = max(worst.get((name, "start"), -math.inf), above_start / size)

    print("\nwall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items()))
    criteria = [("(a) LoRA from the import, ZeRO-3: exit 0, every rank's max RSS above baseline", "lora", "max"),
                ("(b) from scratch, ZeRO-3: exit 0, every rank's start RSS above baseline", "scratch", "start")]
    failed = False
    for text, name, which in criteria:
        if name not in runs:
            print(f"skipped: {text} (--only)")
            continue
        ratio = worst.get((name, which), math.inf) if len(memory[name]) == NPROC else math.inf
        ok = codes[name] == 0 and ratio <= RATIO_LIMIT
        failed |= not ok
        print(f"{'PASS' if ok else 'FAIL'}: {text} <= {RATIO_LIMIT} x fp32 (exit {codes[name]}, "
              f"worst rank {ratio:.2f} x)")
    return 1 if failed else 0


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


if __name__ == "__main__":
    sys.exit(main())
