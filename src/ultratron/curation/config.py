"""Typed configuration of the curation pipeline (`ultratron data run --config data.toml`).

One dataclass per TOML section, built on `ultratron.config.loader` like the trainer's config:
a TOML file, then `--section.field value` overrides, with did-you-mean errors for unknown
sections and fields. Fixed sets of allowed values are `choices` in the field's metadata; every
rule that involves a value's range or several fields is in `validate`. Problems are reported
together, one line each, as a `ConfigError`. Thresholds name their source next to them;
docs/data.md explains them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ultratron.config.loader import build, choice_problems
from ultratron.errors import ConfigError
from ultratron.fields import option

# Stage name → what it does, in pipeline order (also the help of `ultratron data`).
STAGES: dict[str, str] = {
    "read": "raw sources (text files, JSONL, Parquet, 'builtin') → JSONL parts; unusable input logged "
            "with a reason",
    "normalize": "Unicode normal form, control characters, line ends, runs of spaces and blank lines",
    "language": "identify each document's language and script (py3langid); keep the listed languages; "
                "later stages use its words, stop words and rules",
    "exact-dedup": "drop documents whose text equals an earlier one's (blake2b-128)",
    "near-dedup": "MinHash + LSH banding: keep the first document of each near-duplicate cluster",
    "substring-dedup": "remove every byte span of ≥ min_bytes that occurs twice (suffix array)",
    "filter": "heuristic quality rules: Gopher repetition and quality, C4, FineWeb, punctuation",
    "decontaminate": "remove documents (or cut the spans) that repeat a 13-gram of an evaluation task's items",
    "pii": "replace email addresses, public IP addresses and phone numbers by <EMAIL>, <IP_ADDRESS>, <PHONE>",
    "perplexity": "score with a reference model checkpoint; keep the likely documents",
    "tokenize": "train or load the tokenizer, audit it, add token ids to every document",
    "shard": "the trainer's token shards (train/, val/) and Parquet shards of the cleaned text",
    "write-chat": "read.format=chat: the surviving conversations, unchanged, as chat JSONL that "
                  "`train --data.format chat` reads",
}
# With read.format = "chat" a document is a conversation that must come out unchanged: the stages
# that rewrite text (normalize, substring-dedup, C4's line removal) or turn it into plain-text
# shards (tokenize, shard) do not apply; write-chat writes the survivors.
CHAT_STAGES = ("read", "exact-dedup", "near-dedup", "filter", "perplexity", "write-chat")
# Stages the default pipeline leaves out (configs/data.toml and data-multilingual.toml name those they run).
OPT_IN_STAGES = ("language", "decontaminate", "pii", "perplexity", "write-chat")
FILTER_GROUPS = ("length", "gopher_repetition", "gopher_quality", "c4", "fineweb", "punctuation")
READ_FORMATS = ("text", "chat")
PII_KINDS = ("email", "ip", "phone")
NORMAL_FORMS = ("NFC", "NFKC", "NFD", "NFKD")


@dataclass
class PipelineSection:
    input: str = option("builtin", "'builtin' (this interpreter's standard library) or a directory/file of "
                                   "text, .jsonl[.gz|.zst], .parquet, Arrow IPC or WARC; local or an fsspec URL "
                                   "(s3://bucket/prefix)")
    output: str = option("data_out", "one subdirectory per stage, the report and the final shards; local or an "
                                     "fsspec URL (the stages run in pipeline.staging, then each file is published)")
    staging: str = option("", "where the stages run when pipeline.output is a URL (kept for resume); '': "
                              "~/.cache/ultratron/curation/HASH-OF-OUTPUT")
    endpoint: str = option("", "endpoint URL of an S3-compatible store for s3:// input or output")
    stages: list[str] = option(factory=lambda: [s for s in STAGES if s not in OPT_IN_STAGES],
                               help="the stages to run, in order; must start with read", choices=tuple(STAGES))
    workers: int = option(1, "processes on this machine; 0: one per CPU core")
    executor: str = option("local", "local: a process pool; ray: Ray tasks (ray.init(address=ray_address))",
                           choices=("local", "ray"))
    ray_address: str = option("", "'' starts a local Ray instance; 'auto' joins a running cluster")
    shared_fs: bool = option(True, "ray: every node sees pipeline.output; false: parts travel to and from the "
                                   "workers through Ray (set by an object-store output)")
    docs_per_part: int = option(2000, "documents per part: the unit of parallel work and of resume")
    progress: bool = option(True, "progress bars")


@dataclass
class ReadSection:
    format: str = option("text", "text: documents of text; chat: JSONL conversations in the messages format, "
                                 "one a document (see docs/data.md)", choices=READ_FORMATS)
    extensions: str = option(".txt,.md,.rst,.py,.jsonl,.parquet", "files read from a directory or prefix (each "
                                                                  "also compressed: .gz, .zst); add .arrow (Arrow "
                                                                  "IPC) or .warc (needs warcio)")
    max_doc_bytes: int = option(2_000_000, "larger single documents are dropped as 'too_large'")
    max_bytes: int = option(0, "stop after this many bytes of accepted text; 0 reads everything")
    binary_control_fraction: float = option(0.01, "a NUL, or more than this share of C0 control characters, "
                                                  "marks a file 'binary'")


@dataclass
class NormalizeSection:
    form: str = option("NFC", "Unicode normal form", choices=NORMAL_FORMS)
    strip_control: bool = option(True, "drop C0/C1 control characters except tab and newline")
    collapse_spaces: bool = option(True, "runs of spaces/tabs inside a line → one space; trailing spaces dropped")
    keep_code_spaces: bool = option(True, "collapse_spaces leaves lines of code as they are (docs/data.md says "
                                          "which lines are code); false: every line, as before")
    max_blank_lines: int = option(2, "longer runs of blank lines are shortened to this")


@dataclass
class LanguageSection:
    keep: list[str] = option(factory=list, help="ISO 639-1 codes of the languages to keep (e.g. ko,en); empty: all")
    min_score: float = option(0.0, "documents whose language's probability is lower are removed")
    head_chars: int = option(4000, "characters identified per document (its head)")


@dataclass
class NearDedupSection:
    # datatrove's MinHash defaults: word 5-grams, 14 bands × 8 rows = 112 permutations; the
    # S-curve threshold (1/14)^(1/8) ≈ 0.72, P(caught | J=0.8) ≈ 0.92, J=0.85 → 0.99, J=0.5 → 0.05.
    ngram: int = option(5, "word n-grams (shingles)")
    bands: int = option(14, "LSH bands")
    rows: int = option(8, "MinHash values per band (bands × rows permutations)")
    seed: int = option(1, "seed of the MinHash permutations")
    min_jaccard: float = option(0.0, "a pair whose bands collide is a duplicate only if its signatures agree "
                                     "in this share of values (estimated Jaccard); 0: every collision counts")


@dataclass
class SubstringDedupSection:
    # Lee et al. 2022 remove repeated spans of ≥ 50 tokens ≈ 100 bytes.
    min_bytes: int = option(100, "repeated spans at least this long are removed")
    min_doc_chars: int = option(1, "a document left shorter than this after trimming is removed")


@dataclass
class FilterSection:
    enabled: list[str] = option(factory=lambda: list(FILTER_GROUPS), help="the rule groups to apply, in order",
                                choices=FILTER_GROUPS)
    # length: plain bounds (no source; both off by default), e.g. for conversations, whose text the
    # prose rules below were not made for
    min_chars: int = option(0, "length: fewest characters of a document's text")
    max_chars: int = option(0, "length: most characters of a document's text; 0: no bound")
    # Gopher repetition (Rae et al. 2021, Table A1; datatrove GopherRepetitionFilter defaults)
    dup_line_frac: float = option(0.30, "gopher_repetition: share of lines that repeat an earlier line")
    dup_para_frac: float = option(0.30, "gopher_repetition: share of paragraphs that repeat an earlier one")
    dup_line_char_frac: float = option(0.20, "gopher_repetition: share of characters in repeated lines")
    dup_para_char_frac: float = option(0.20, "gopher_repetition: share of characters in repeated paragraphs")
    top_ngram_char_frac: dict[str, float] = option(
        factory=lambda: {"2": 0.20, "3": 0.18, "4": 0.16},
        help="gopher_repetition: n → character share of the most common n-gram")
    dup_ngram_char_frac: dict[str, float] = option(
        factory=lambda: {"5": 0.15, "6": 0.14, "7": 0.13, "8": 0.12, "9": 0.11, "10": 0.10},
        help="gopher_repetition: n → character share of n-grams that occur more than once")
    # Gopher quality (Rae et al. 2021; datatrove GopherQualityFilter defaults)
    min_words: int = option(50, "gopher_quality: fewest words")
    max_words: int = option(100_000, "gopher_quality: most words")
    min_mean_word_len: float = option(3.0, "gopher_quality: shortest mean word length")
    max_mean_word_len: float = option(10.0, "gopher_quality: longest mean word length")
    max_symbol_word_ratio: float = option(0.10, "gopher_quality: '#' and '…'/'...' per word")
    max_bullet_lines_frac: float = option(0.90, "gopher_quality: share of lines starting with a bullet")
    max_ellipsis_lines_frac: float = option(0.30, "gopher_quality: share of lines ending with an ellipsis")
    min_alpha_words_frac: float = option(0.80, "gopher_quality: share of words with a letter")
    min_stop_words: int = option(2, "gopher_quality: fewest English stop words")
    # C4 (Raffel et al. 2020; datatrove C4QualityFilter): lines without terminal punctuation or
    # with < 3 words are removed; the document must keep ≥ 5 sentences; lorem ipsum, "{" and
    # "javascript" are dropped.
    c4_min_words_per_line: int = option(3, "c4: lines with fewer words are removed")
    c4_min_sentences: int = option(5, "c4: documents left with fewer sentences are dropped")
    # FineWeb (Penedo et al. 2024; datatrove FineWebQualityFilter)
    min_line_punct_ratio: float = option(0.12, "fineweb: share of lines ending in punctuation")
    max_short_line_frac: float = option(0.67, "fineweb: share of short lines")
    short_line_chars: int = option(30, "fineweb: a line this long or shorter is short")
    max_dup_char_line_frac: float = option(0.01, "fineweb: characters in duplicated lines / all characters")
    max_newline_ratio: float = option(0.30, "fineweb: newlines per word")
    # Punctuation density (ours): bounds chosen so prose (~3–6%) and code (~15–25%) pass and
    # symbol soup (> 40%) does not.
    max_punct_frac: float = option(0.40, "punctuation: share of non-space characters that are punctuation "
                                         "or symbols")


@dataclass
class DecontaminateSection:
    # GPT-3 (Brown et al. 2020, appendix C), lm-eval-harness and Megatron's tools: 13-grams
    tasks: str = option("builtin", "the evaluation tasks, as eval.tasks spells them: builtin, built-in task "
                                   "names, task files (.jsonl ultratron or lm-eval style, BIG-bench .json)")
    ngram: int = option(13, "words per n-gram (after lowercasing and stripping punctuation)")
    mode: str = option("remove", "remove: drop a document that repeats an item's n-gram; cut: drop only the "
                                 "spans those n-grams cover", choices=("remove", "cut"))
    held_out_fraction: float = option(0.05, "the built-in suite's split: the data.held_out_fraction of the runs "
                                            "that will be evaluated on it")
    min_doc_chars: int = option(1, "cut: a document left shorter than this is removed")


@dataclass
class PiiSection:
    kinds: list[str] = option(factory=lambda: list(PII_KINDS), help="what is replaced: email (<EMAIL>), ip "
                              "(public addresses, <IP_ADDRESS>), phone (<PHONE>)", choices=PII_KINDS)


@dataclass
class PerplexitySection:
    checkpoint: str = option("", "the reference model: an ultratron checkpoint or run directory")
    tokenizer: str = option("", "tokenizer.json of that model; '': the checkpoint's own")
    max_perplexity: float = option(0.0, "keep documents at or below; 0 disables the absolute threshold")
    keep_percentile: float = option(0.0, "keep the lowest-perplexity share (0 < p ≤ 100); 0 disables")
    max_tokens: int = option(512, "tokens scored per document (its head)")
    batch_size: int = option(8, "documents per forward pass")


@dataclass
class TokenizeSection:
    tokenizer: str = option("", "load this tokenizer.json; '': train one on the stage input")
    vocab_size: int = option(4096, "vocabulary of a trained tokenizer")
    train_bytes: int = option(50_000_000, "the tokenizer trains on at most this much text")
    poor_compression_ratio: float = option(0.5, "audit: warn when a domain's bytes/token < ratio × the corpus's")
    # a corpus balanced by language for training (records with a `language`): each language's share of
    # the training text ∝ (its share of the corpus)^alpha (Conneau et al. 2020, XLM-R; Xue et al. 2021,
    # mT5: alpha 0.3), or the explicit weights
    language_alpha: float = option(1.0, "tokenizer training text per language ∝ share^alpha (1: as the corpus "
                                        "has it; 0.3 as XLM-R and mT5)")
    language_weights: dict[str, float] = option(factory=dict, help="language → relative weight of its text for "
                                                                   "tokenizer training (overrides language_alpha)")


@dataclass
class ShardSection:
    held_out_fraction: float = option(0.05, "share of documents for val/, by a hash of the document id "
                                            "(as ultratron.data.sources.held_out)")
    tokens_per_shard: int = option(50_000_000, "tokens per .bin shard")
    parquet: bool = option(True, "also write the cleaned text as Parquet (one file per part) for streaming")


@dataclass
class DataPipelineConfig:
    pipeline: PipelineSection = option(factory=PipelineSection)
    read: ReadSection = option(factory=ReadSection)
    normalize: NormalizeSection = option(factory=NormalizeSection)
    language: LanguageSection = option(factory=LanguageSection)
    near_dedup: NearDedupSection = option(factory=NearDedupSection)
    substring_dedup: SubstringDedupSection = option(factory=SubstringDedupSection)
    filter: FilterSection = option(factory=FilterSection)
    decontaminate: DecontaminateSection = option(factory=DecontaminateSection)
    pii: PiiSection = option(factory=PiiSection)
    perplexity: PerplexitySection = option(factory=PerplexitySection)
    tokenize: TokenizeSection = option(factory=TokenizeSection)
    shard: ShardSection = option(factory=ShardSection)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                data: dict[str, Any] | None = None, stages: list[str] | None = None) -> DataPipelineConfig:
    """Defaults, then a data.toml and/or a parsed dict, then `--section.field value` overrides;
    validated for `stages` (default: pipeline.stages), e.g. one stage run alone."""
    cfg = build(DataPipelineConfig, path, overrides, data)
    problems = validate(cfg, stages)
    if problems:
        raise ConfigError(problems)
    return cfg


def from_dict(data: dict[str, Any]) -> DataPipelineConfig:
    """A config from a dict shaped like data.toml ({section: {field: value}})."""
    return load_config(data=data)


def _ngram_table_problems(name: str, table: dict[str, float]) -> list[str]:
    problems = []
    for n, limit in table.items():
        if not (n.isdigit() and int(n) >= 1):
            problems.append(f"{name}: key {n!r} must be an n-gram length ≥ 1, e.g. \"2\"")
        if not 0 <= limit <= 1:
            problems.append(f"{name}[{n!r}] = {limit} must lie in [0, 1]")
    return problems


def _chat_problems(cfg: DataPipelineConfig, run: list[str]) -> list[str]:
    """Stages and filters that cannot keep a conversation unchanged, with the list that can."""
    if cfg.read.format != "chat":
        needs_chat = "write-chat" in run
        return ["stage 'write-chat' needs read.format = 'chat' (it writes conversations)"] if needs_chat else []
    problems = []
    other = [s for s in run if s not in CHAT_STAGES]
    if other:
        keep = [s for s in run if s in CHAT_STAGES] + ([] if "write-chat" in run else ["write-chat"])
        problems.append(f"read.format = 'chat': stage(s) {', '.join(other)} would rewrite the conversations' text or "
                        f"make plain-text shards of it; use pipeline.stages = {keep} (write-chat writes the "
                        "conversations that `train --data.format chat` reads)")
    if "filter" in run and "c4" in cfg.filter.enabled:
        problems.append("read.format = 'chat': filter group 'c4' removes lines, which a conversation cannot follow; "
                        f"leave it out of filter.enabled (e.g. {[g for g in cfg.filter.enabled if g != 'c4']})")
    return problems


def validate(cfg: DataPipelineConfig, stages: list[str] | None = None) -> list[str]:
    """Every problem of the config, one line each: choices first, then ranges and cross-field rules."""
    problems = choice_problems(cfg)
    p = cfg.pipeline
    run = p.stages if stages is None else stages
    if len(set(p.stages)) != len(p.stages):
        problems.append("pipeline.stages lists a stage twice")
    if p.stages and p.stages[0] != "read":
        problems.append(f"pipeline.stages must start with 'read' (got {p.stages[0]!r})")
    if "shard" in p.stages and "tokenize" not in p.stages[:p.stages.index("shard")]:
        problems.append("pipeline.stages: 'shard' needs 'tokenize' before it")
    if p.workers < 0:
        problems.append(f"pipeline.workers = {p.workers} must be ≥ 0 (0: one per CPU core)")
    if p.docs_per_part < 1:
        problems.append("pipeline.docs_per_part must be ≥ 1")
    problems += _chat_problems(cfg, run)
    lg = cfg.language
    if not 0 <= lg.min_score <= 1:
        problems.append(f"language.min_score = {lg.min_score} must lie in [0, 1] (a probability)")
    if lg.head_chars < 1:
        problems.append("language.head_chars must be ≥ 1")
    bad = [code for code in lg.keep if not (2 <= len(code) <= 3 and code.isalpha() and code.islower())]
    if bad:
        problems.append(f"language.keep: {bad[0]!r} is not an ISO 639-1 code (two lowercase letters, e.g. ko, en)")
    nd = cfg.near_dedup
    if nd.ngram < 1 or nd.bands < 1 or nd.rows < 1:
        problems.append("near_dedup.ngram, bands and rows must be ≥ 1")
    if not 0 <= nd.min_jaccard <= 1:
        problems.append(f"near_dedup.min_jaccard = {nd.min_jaccard} must lie in [0, 1]")
    if cfg.substring_dedup.min_bytes < 8:
        problems.append(f"substring_dedup.min_bytes = {cfg.substring_dedup.min_bytes} is too small "
                        "(≥ 8; 100 is usual)")
    if cfg.filter.min_chars < 0 or cfg.filter.max_chars < 0:
        problems.append("filter.min_chars and filter.max_chars must be ≥ 0 (max_chars 0: no bound)")
    elif 0 < cfg.filter.max_chars < cfg.filter.min_chars:
        problems.append(f"filter.max_chars = {cfg.filter.max_chars} is below filter.min_chars = {cfg.filter.min_chars}")
    problems += _ngram_table_problems("filter.top_ngram_char_frac", cfg.filter.top_ngram_char_frac)
    problems += _ngram_table_problems("filter.dup_ngram_char_frac", cfg.filter.dup_ngram_char_frac)
    dc = cfg.decontaminate
    if dc.ngram < 1:
        problems.append(f"decontaminate.ngram = {dc.ngram} must be ≥ 1 (13 is usual; GPT-3 took 8 for short items)")
    if not 0 < dc.held_out_fraction < 1:
        problems.append(f"decontaminate.held_out_fraction = {dc.held_out_fraction} must lie in (0, 1)")
    if dc.min_doc_chars < 1:
        problems.append("decontaminate.min_doc_chars must be ≥ 1")
    if "decontaminate" in run and not dc.tasks.strip(", "):
        problems.append("stage 'decontaminate' needs decontaminate.tasks (e.g. builtin, or task files)")
    px = cfg.perplexity
    if not 0 <= px.keep_percentile <= 100:
        problems.append(f"perplexity.keep_percentile = {px.keep_percentile} must lie in [0, 100]")
    if px.max_tokens < 2 or px.batch_size < 1:
        problems.append("perplexity.max_tokens must be ≥ 2 and perplexity.batch_size ≥ 1")
    if "perplexity" in run and not px.checkpoint:
        problems.append("stage 'perplexity' needs perplexity.checkpoint (a model checkpoint directory)")
    if "perplexity" in run and not (px.max_perplexity or px.keep_percentile):
        problems.append("stage 'perplexity' needs perplexity.max_perplexity or perplexity.keep_percentile")
    if not 0 < cfg.tokenize.language_alpha <= 1:
        problems.append(f"tokenize.language_alpha = {cfg.tokenize.language_alpha} must lie in (0, 1]")
    if any(not (isinstance(w, int | float) and w >= 0) for w in cfg.tokenize.language_weights.values()):
        problems.append("tokenize.language_weights: every weight must be a number ≥ 0")
    if cfg.tokenize.vocab_size < 258:
        problems.append(f"tokenize.vocab_size = {cfg.tokenize.vocab_size} is too small (≥ 258)")
    if not 0 <= cfg.shard.held_out_fraction < 1:
        problems.append("shard.held_out_fraction must lie in [0, 1)")
    if cfg.shard.tokens_per_shard < 1:
        problems.append("shard.tokens_per_shard must be ≥ 1")
    return problems
