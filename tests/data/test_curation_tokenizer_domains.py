"""The tokenize stage reports its tokenizer's figures on the audit's probe texts per domain — code and
mathematics beside the scripts — in its summary and in report.md."""

import json

from ultratron.curation.config import from_dict
from ultratron.curation.runner import run_pipeline


def test_code_and_math_get_bytes_per_token_and_round_trip_in_the_report(tmp_path, small_corpus):
    cfg = from_dict({"pipeline": {"input": str(small_corpus), "output": str(tmp_path / "out"), "progress": False,
                                  "stages": ["read", "tokenize"]}, "tokenize": {"vocab_size": 400}})
    report = run_pipeline(cfg, log=lambda line: None)
    domains = report["stages"][-1]["tokenizer_domains"]
    assert {"code", "math", "english", "chinese"} <= set(domains)
    for name in ("code", "math"):
        assert domains[name]["round_trip"] and domains[name]["bytes_per_token"] > 1.0, (name, domains[name])
    md = (tmp_path / "out" / "report.md").read_text()
    section = md.split("## Tokenizer by domain")[1]
    for name in ("code", "math"):
        row = next(line for line in section.splitlines() if line.startswith(f"| {name} |"))
        assert row.endswith("| yes |") and str(domains[name]["bytes_per_token"]) in row
    assert json.loads((tmp_path / "out" / "01-tokenize" / "audit.json").read_text())["domains"] == domains
