"""The curation config: loaded by config.loader (file, then overrides), choices and rules
checked together, the stage list the same everywhere, and `ultratron data --help` from it."""

from __future__ import annotations

import pytest

from conftest import run_cli
from ultratron.curation.config import STAGES, DataPipelineConfig, from_dict, load_config, validate
from ultratron.curation.stages import RUNNERS
from ultratron.errors import ConfigError


def test_every_stage_has_a_runner_in_pipeline_order():
    assert list(RUNNERS) == list(STAGES)
    # language (configs/data-multilingual.toml), decontaminate and pii are opt-in: the default pipeline
    # stays as it was
    assert DataPipelineConfig().pipeline.stages == ["read", "normalize", "exact-dedup", "near-dedup",
                                                    "substring-dedup", "filter", "tokenize", "shard"]


def test_file_then_overrides(tmp_path):
    path = tmp_path / "data.toml"
    path.write_text('[pipeline]\nworkers = 3\noutput = "from-file"\n[filter]\nenabled = ["c4"]\n')
    cfg = load_config(path, ["--pipeline.workers", "2", "--filter.enabled", "punctuation,fineweb",
                             "--near_dedup.bands=7", "--shard.parquet", "false"])
    assert cfg.pipeline.workers == 2 and cfg.pipeline.output == "from-file"
    assert cfg.filter.enabled == ["punctuation", "fineweb"]
    assert cfg.near_dedup.bands == 7 and cfg.shard.parquet is False


def test_choices_and_rules_are_reported_together():
    with pytest.raises(ConfigError) as err:
        from_dict({"pipeline": {"executor": "spark", "stages": ["read", "tokenize", "shard", "shard"]},
                   "normalize": {"form": "nfc"}, "filter": {"enabled": ["c4", "gopher"]},
                   "tokenize": {"vocab_size": 100}})
    problems = err.value.problems
    assert problems[:4] == [
        "pipeline.executor: 'spark' is not one of local, ray",
        "normalize.form: 'nfc' is not one of NFC, NFKC, NFD, NFKD",
        "filter.enabled: 'gopher' is not one of length, gopher_repetition, gopher_quality, c4, fineweb, punctuation "
        "(did you mean 'gopher_quality'?)",
        "pipeline.stages lists a stage twice",
    ]
    assert problems[4:] == ["tokenize.vocab_size = 100 is too small (≥ 258)"]


def test_ngram_tables_must_map_lengths_to_fractions():
    problems = validate(from_dict({}))
    assert problems == []
    cfg = from_dict({})
    cfg.filter.top_ngram_char_frac = {"2": 0.2, "two": 0.1}
    cfg.filter.dup_ngram_char_frac = {"5": 1.5}
    assert validate(cfg) == ["filter.top_ngram_char_frac: key 'two' must be an n-gram length ≥ 1, e.g. \"2\"",
                             "filter.dup_ngram_char_frac['5'] = 1.5 must lie in [0, 1]"]
    # on the command line a table is KEY=NUMBER pairs
    assert load_config(overrides=["--filter.top_ngram_char_frac", "2=0.3,3=0.25"]).filter.top_ngram_char_frac == {
        "2": 0.3, "3": 0.25}
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["--filter.top_ngram_char_frac", "2:0.3"])
    assert err.value.problems == ["filter.top_ngram_char_frac: expected KEY=NUMBER pairs separated by commas, "
                                  "got '2:0.3'"]


def test_a_stage_run_alone_is_checked_for_what_it_needs():
    cfg = load_config()  # the pipeline's stages leave perplexity out, so no checkpoint is needed
    assert cfg.perplexity.checkpoint == ""
    with pytest.raises(ConfigError) as err:
        load_config(stages=["perplexity"])
    assert err.value.problems == [
        "stage 'perplexity' needs perplexity.checkpoint (a model checkpoint directory)",
        "stage 'perplexity' needs perplexity.max_perplexity or perplexity.keep_percentile"]


def test_conversations_refuse_the_stages_and_filters_that_would_change_them():
    """read.format = 'chat' keeps each conversation unchanged: the text-rewriting stages and C4's
    line removal are refused with the list that works; write-chat needs chat input."""
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["--read.format", "chat", "--filter.min_chars", "9", "--filter.max_chars", "3"])
    assert err.value.problems == [
        "read.format = 'chat': stage(s) normalize, substring-dedup, tokenize, shard would rewrite the conversations' "
        "text or make plain-text shards of it; use pipeline.stages = ['read', 'exact-dedup', 'near-dedup', "
        "'filter', 'write-chat'] (write-chat writes the conversations that `train --data.format chat` reads)",
        "read.format = 'chat': filter group 'c4' removes lines, which a conversation cannot follow; leave it out "
        "of filter.enabled (e.g. ['length', 'gopher_repetition', 'gopher_quality', 'fineweb', 'punctuation'])",
        "filter.max_chars = 3 is below filter.min_chars = 9"]
    chat = load_config(overrides=["--read.format", "chat", "--pipeline.stages", "read,exact-dedup,write-chat"])
    assert chat.pipeline.stages == ["read", "exact-dedup", "write-chat"]
    with pytest.raises(ConfigError) as err:
        load_config(stages=["write-chat"])
    assert err.value.problems == ["stage 'write-chat' needs read.format = 'chat' (it writes conversations)"]


def test_bad_override_is_one_error_line_and_exit_2_without_traceback():
    result = run_cli("data", "run", "--pipeline.workerz", "2")
    assert result.returncode == 2
    assert result.stderr == "error: unknown config field 'pipeline.workerz' (did you mean 'workers'?)\n"


def test_help_lists_the_stages_and_the_config_fields(capsys):
    from ultratron.cli import main

    for argv in (["data", "--help"], ["data", "run", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        for name, text in STAGES.items():
            assert f"  {name:<16} {text}" in out
        assert "  --pipeline.workers (1): processes on this machine; 0: one per CPU core" in out
        assert "  --filter.enabled ([" in out and "  --shard.tokens_per_shard (50000000)" in out
