"""PII: planted emails, public IP addresses and phone numbers are all replaced; private and reserved
addresses, version strings, dates and plain numbers are left as they are."""

from __future__ import annotations

import json
import random

from ultratron.curation.config import from_dict
from ultratron.curation.runner import run_pipeline
from ultratron.curation.stages.pii import scrub

EMAILS = ["jane.doe@example.com", "J.Smith+news@mail.co.uk", "a_b-c%d@sub.domain.org", "x1@b2.io",
          "firstname.lastname@company-name.de"]
PUBLIC_IPS = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "151.101.1.69", "2606:4700:4700::1111",
              "2a00:1450:4001:82b::200e", "2001:4860:4860::8888"]
PHONES = ["+1 (555) 123-4567", "555-123-4567", "(020) 7946 0958", "+44 20 7946 0958", "+49 30 901820",
          "+82-2-312-3456", "555.123.4567", "+33 1 23 45 67 89"]
KEPT = ["10.0.0.1", "172.16.5.4", "192.168.1.20", "127.0.0.1", "169.254.10.10", "100.64.0.1", "0.0.0.0",
        "255.255.255.255", "224.0.0.251", "192.0.2.10", "198.51.100.7", "203.0.113.99", "::1",
        "fe80::1ff:fe23:4567:890a",
        "fd12:3456:789a::1", "2001:db8::ff00:42:8329", "version 1.2.3.4", "v1.2.3.4", 'VERSION = "4.3.2.1"',
        "release 9.9.9.9", "build 5.6.7.8", "ver. 4.4.4.4", "Revision 20.30.40.50",
        "1.2.3.4.5", "2024-01-15", "15.01.2024", "01/15/2024", "12:30:45",
        "2024-12-31T23:59:59", "100 000 000", "1,234,567", "3.14159265", "x = 10 - 20 - 30", "ISBN 978-3-16-148410-0",
        "call extension 1234", "in 1999 2000 people", "port 8080", "12.5.2023", "1999-2024", "2024-01-15 10:30",
        "version 555-123-4567"]


def _planted(rng: random.Random) -> tuple[str, str, dict]:
    """A text holding one value of each kind among filler, with what it should become and the counts."""
    filler = "The meeting notes say that {} was mentioned, next to {} and {}, before lunch."
    email, ip, phone = rng.choice(EMAILS), rng.choice(PUBLIC_IPS), rng.choice(PHONES)
    kept = rng.sample(KEPT, 3)
    order = [(email, "<EMAIL>"), (ip, "<IP_ADDRESS>"), (phone, "<PHONE>")]
    rng.shuffle(order)
    text = filler.format(*(v for v, _ in order)) + " Also: " + "; ".join(kept) + "."
    want = filler.format(*(p for _, p in order)) + " Also: " + "; ".join(kept) + "."
    return text, want, {"email": 1, "ip": 1, "phone": 1}


def test_every_kind_is_replaced_and_every_look_alike_kept():
    for value, placeholder in [*((e, "<EMAIL>") for e in EMAILS), *((i, "<IP_ADDRESS>") for i in PUBLIC_IPS),
                               *((p, "<PHONE>") for p in PHONES)]:
        for text in (value, f"contact: {value}.", f"({value})", f"{value}, or"):
            assert scrub(text)[0] == text.replace(value, placeholder), text
    for value in KEPT:
        for text in (value, f"see {value}.", f"({value})"):
            assert scrub(text) == (text, {}), text


def test_the_stage_replaces_every_planted_value_and_reports_the_counts(tmp_path):
    rng = random.Random(0)
    docs, want = [], {}
    for i in range(200):
        text, expected, _ = _planted(rng)
        docs.append({"id": f"d{i}", "text": text})
        want[f"d{i}"] = expected
    docs.append({"id": "clean", "text": "Nothing personal here: version 2.0.1.3 shipped on 2024-05-01."})
    src = tmp_path / "in"
    src.mkdir()
    (src / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    cfg = from_dict({"pipeline": {"input": str(src), "output": str(tmp_path / "out"), "stages": ["read", "pii"],
                                  "progress": False}})
    report = run_pipeline(cfg, log=lambda line: None)
    out = {r["id"]: r["text"] for r in map(json.loads, (tmp_path / "out" / "01-pii" / "part-00000.jsonl")
                                           .read_text().splitlines())}
    assert {i: out[i] for i in want} == want and out["clean"] == docs[-1]["text"]
    pii = report["stages"][-1]
    assert pii["pii_replaced"] == {"email": 200, "ip": 200, "phone": 200} and pii["modified"] == {"pii": 200}
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Personal data replaced (200 documents changed)" in md and "| phone | 200 |" in md


def test_the_stage_alone_prints_the_counts(tmp_path, capsys):
    from ultratron.cli import main

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "text": "mail bob@corp.com or call +1 (555) 123-4567 from 10.0.0.1"}) + "\n")
    assert main(["data", "pii", "--input", str(src), "--output", str(tmp_path / "out")]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["pii_replaced"] == {"email": 1, "ip": 0, "phone": 1} and shown["modified"] == {"pii": 1}
