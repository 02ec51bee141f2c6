"""Typed configuration of the curation pipeline (`ultratron data run --config data.toml`).

One dataclass per TOML section. Unknown sections or keys, wrong types and impossible values
are collected and reported together as one `DataConfigError`, one line each. Every threshold
names its source next to it; docs/data.md explains them.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ultratron.config.loader import apply_tables, did_you_mean
from ultratron.errors import UserError

STAGES = ("read", "normalize", "exact-dedup", "near-dedup", "substring-dedup", "filter", "perplexity",
          "tokenize", "shard")
FILTER_GROUPS = ("gopher_repetition", "gopher_quality", "c4", "fineweb", "punctuation")


class DataConfigError(UserError):
    """A data.toml the user can fix."""


@dataclass
class PipelineSection:
    # "builtin" (the interpreter's stdlib) or a directory/file of text, .jsonl or .parquet
    input: str = "builtin"
    output: str = "data_out"  # one subdirectory per stage, the report and the final shards
    stages: list[str] = field(default_factory=lambda: [s for s in STAGES if s != "perplexity"])
    workers: int = 1  # processes on this machine; 0 = one per CPU core
    executor: str = "local"  # "local" (process pool) | "ray" (ray.init(address=ray_address))
    ray_address: str = ""  # "" starts a local Ray instance; "auto" joins a running cluster
    docs_per_part: int = 2000  # the unit of parallel work and of resume
    progress: bool = True


@dataclass
class ReadSection:
    extensions: str = ".txt,.md,.rst,.py,.jsonl,.parquet"
    max_doc_bytes: int = 2_000_000  # larger single documents are dropped as "too_large"
    max_bytes: int = 0  # stop after this many bytes of accepted text; 0 reads everything
    binary_control_fraction: float = 0.01  # NUL or > this share of C0 control bytes → "binary"


@dataclass
class NormalizeSection:
    form: str = "NFC"  # Unicode normal form
    strip_control: bool = True  # drop C0/C1 control characters except tab and newline
    collapse_spaces: bool = True  # runs of spaces/tabs inside a line → one space; trailing spaces dropped
    max_blank_lines: int = 2  # longer runs of blank lines are shortened to this


@dataclass
class ExactDedupSection:
    key: str = "text"  # hash of the normalized text (blake2b, 128 bits)


@dataclass
class NearDedupSection:
    # datatrove's MinHash defaults (REFERENCES.md "Data curation"): word 5-grams, 14 bands × 8
    # rows = 112 permutations; the S-curve threshold (1/14)^(1/8) ≈ 0.72, P(caught | J=0.8) ≈ 0.92,
    # J=0.85 → 0.99, J=0.5 → 0.05.
    ngram: int = 5
    bands: int = 14
    rows: int = 8
    seed: int = 1


@dataclass
class SubstringDedupSection:
    # Lee et al. 2022 remove repeated spans of ≥ 50 tokens ≈ 100 bytes (REFERENCES.md).
    min_bytes: int = 100
    min_doc_chars: int = 1  # a document left shorter than this after trimming is removed


@dataclass
class FilterSection:
    enabled: list[str] = field(default_factory=lambda: list(FILTER_GROUPS))
    # Gopher repetition (Rae et al. 2021, Table A1; datatrove GopherRepetitionFilter defaults)
    dup_line_frac: float = 0.30
    dup_para_frac: float = 0.30
    dup_line_char_frac: float = 0.20
    dup_para_char_frac: float = 0.20
    top_ngram_char_frac: dict[str, float] = field(default_factory=lambda: {"2": 0.20, "3": 0.18, "4": 0.16})
    dup_ngram_char_frac: dict[str, float] = field(
        default_factory=lambda: {"5": 0.15, "6": 0.14, "7": 0.13, "8": 0.12, "9": 0.11, "10": 0.10})
    # Gopher quality (Rae et al. 2021; datatrove GopherQualityFilter defaults)
    min_words: int = 50
    max_words: int = 100_000
    min_mean_word_len: float = 3.0
    max_mean_word_len: float = 10.0
    max_symbol_word_ratio: float = 0.10  # "#" and "…"/"..." per word
    max_bullet_lines_frac: float = 0.90
    max_ellipsis_lines_frac: float = 0.30
    min_alpha_words_frac: float = 0.80
    min_stop_words: int = 2
    # C4 (Raffel et al. 2020; datatrove C4QualityFilter): lines without terminal punctuation or
    # with < 3 words are removed; the document must keep ≥ 5 sentences; lorem ipsum, "{" and
    # "javascript" are dropped.
    c4_min_words_per_line: int = 3
    c4_min_sentences: int = 5
    # FineWeb (Penedo et al. 2024; datatrove FineWebQualityFilter)
    min_line_punct_ratio: float = 0.12
    max_short_line_frac: float = 0.67
    short_line_chars: int = 30
    max_dup_char_line_frac: float = 0.01  # chars in duplicated lines / all chars
    max_newline_ratio: float = 0.30  # newlines per word
    # Punctuation density: share of non-space characters that are punctuation (ours; bounds
    # chosen so prose (~3–6%) and code (~15–25%) pass and symbol soup (> 40%) does not).
    max_punct_frac: float = 0.40


@dataclass
class PerplexitySection:
    checkpoint: str = ""  # model checkpoint directory (see ultratron.curation.stages.perplexity.load_scorer)
    tokenizer: str = ""  # tokenizer.json of that model; default: the checkpoint's own
    max_perplexity: float = 0.0  # keep documents at or below; 0 disables the absolute threshold
    keep_percentile: float = 0.0  # keep the lowest-perplexity share (0 < p ≤ 100); 0 disables
    max_tokens: int = 512  # tokens scored per document (the head of the document)
    batch_size: int = 8


@dataclass
class TokenizeSection:
    tokenizer: str = ""  # load this tokenizer.json; "" trains one on the stage input
    vocab_size: int = 4096
    train_bytes: int = 50_000_000  # the tokenizer trains on at most this much text
    poor_compression_ratio: float = 0.5  # warn when a domain's bytes/token < ratio × the corpus's


@dataclass
class ShardSection:
    held_out_fraction: float = 0.05  # by hash of the document id, as in ultratron.data.sources.held_out
    tokens_per_shard: int = 50_000_000
    parquet: bool = True  # also write the cleaned text as Parquet for streaming
    parquet_rows_per_file: int = 100_000


@dataclass
class DataPipelineConfig:
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    read: ReadSection = field(default_factory=ReadSection)
    normalize: NormalizeSection = field(default_factory=NormalizeSection)
    exact_dedup: ExactDedupSection = field(default_factory=ExactDedupSection)
    near_dedup: NearDedupSection = field(default_factory=NearDedupSection)
    substring_dedup: SubstringDedupSection = field(default_factory=SubstringDedupSection)
    filter: FilterSection = field(default_factory=FilterSection)
    perplexity: PerplexitySection = field(default_factory=PerplexitySection)
    tokenize: TokenizeSection = field(default_factory=TokenizeSection)
    shard: ShardSection = field(default_factory=ShardSection)


SECTIONS: dict[str, type] = typing.get_type_hints(DataPipelineConfig)


def _suggest(name: str, options) -> str:
    """The config's did-you-mean hint, or the full list when nothing is close (lists here are short)."""
    return did_you_mean(name, list(options)) or f" (known: {', '.join(options)})"


def from_dict(data: dict[str, Any]) -> DataPipelineConfig:
    cfg = DataPipelineConfig()
    problems: list[str] = []
    apply_tables(cfg, data, problems)
    problems += validate(cfg)
    if problems:
        raise DataConfigError(problems)
    return cfg


def validate(cfg: DataPipelineConfig) -> list[str]:
    problems = []
    p = cfg.pipeline
    for stage in p.stages:
        if stage not in STAGES:
            problems.append(f"pipeline.stages: unknown stage {stage!r}{_suggest(stage, STAGES)}")
    if len(set(p.stages)) != len(p.stages):
        problems.append("pipeline.stages lists a stage twice")
    if p.stages and p.stages[0] != "read":
        problems.append(f"pipeline.stages must start with 'read' (got {p.stages[0]!r})")
    if "shard" in p.stages and "tokenize" not in p.stages[:p.stages.index("shard")]:
        problems.append("pipeline.stages: 'shard' needs 'tokenize' before it")
    if p.workers < 0:
        problems.append(f"pipeline.workers = {p.workers} must be ≥ 0 (0: one per CPU core)")
    if p.executor not in ("local", "ray"):
        problems.append(f"pipeline.executor = {p.executor!r}; choose 'local' or 'ray'")
    if p.docs_per_part < 1:
        problems.append("pipeline.docs_per_part must be ≥ 1")
    nd = cfg.near_dedup
    if nd.ngram < 1 or nd.bands < 1 or nd.rows < 1:
        problems.append("near_dedup.ngram, bands and rows must be ≥ 1")
    if cfg.substring_dedup.min_bytes < 8:
        problems.append(f"substring_dedup.min_bytes = {cfg.substring_dedup.min_bytes} is too small "
                        "(≥ 8; 100 is usual)")
    for group in cfg.filter.enabled:
        if group not in FILTER_GROUPS:
            problems.append(f"filter.enabled: unknown filter {group!r}{_suggest(group, FILTER_GROUPS)}")
    if cfg.normalize.form not in ("NFC", "NFKC", "NFD", "NFKD"):
        problems.append(f"normalize.form = {cfg.normalize.form!r}; choose NFC, NFKC, NFD or NFKD")
    px = cfg.perplexity
    if not 0 <= px.keep_percentile <= 100:
        problems.append(f"perplexity.keep_percentile = {px.keep_percentile} must lie in [0, 100]")
    if "perplexity" in p.stages and not px.checkpoint:
        problems.append("stage 'perplexity' needs perplexity.checkpoint (a model checkpoint directory)")
    if "perplexity" in p.stages and not (px.max_perplexity or px.keep_percentile):
        problems.append("stage 'perplexity' needs perplexity.max_perplexity or perplexity.keep_percentile")
    if cfg.tokenize.vocab_size < 258:
        problems.append(f"tokenize.vocab_size = {cfg.tokenize.vocab_size} is too small (≥ 258)")
    if not 0 <= cfg.shard.held_out_fraction < 1:
        problems.append("shard.held_out_fraction must lie in [0, 1)")
    return problems


def load(path: str | Path | None) -> DataPipelineConfig:
    if path is None:
        return from_dict({})
    path = Path(path)
    if not path.is_file():
        raise DataConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise DataConfigError(f"{path}: not valid TOML ({err})") from None
    return from_dict(data)


def to_dict(cfg: DataPipelineConfig) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)
