"""Stage `pii`: email addresses, public IP addresses and phone numbers replaced by typed placeholders.

`<EMAIL>`, `<IP_ADDRESS>` and `<PHONE>` take their place (`pii.kinds` picks which kinds); a
changed document is kept as modified with the reason `pii`, its decision's detail counting the
replacements per kind, and the stage summary (and report.md) counts them for the corpus. What is
left alone, by rule:

- IP addresses that are not public: Python's `ipaddress` says private, reserved, loopback,
  link-local, multicast, unspecified or not global (10/8, 172.16/12, 192.168/16, 127/8, 100.64/10,
  the RFC 5737 and 3849 documentation ranges, fc00::/7, fe80::/10, ...) — not anybody's data.
- Version strings: a dotted quad is a version, not an address, when a version word stands just
  before it (`version`, `ver`, `release`, `build`, `rev`, `revision`, or `v` joined to it:
  "version 1.2.3.4", `__version__ = "1.2.3.4"`, "v8.8.8.8"), or when it is part of a longer dotted
  run of numbers ("1.2.3.4.5").
- Dates and plain numbers are not phone numbers. A phone number is 7 to 15 digits (E.164's most) in
  groups joined by spaces, dots or hyphens; it either starts with a country code (`+44 20 7946
  0958`, `+49 30 901820`: groups of 2–8 digits) or an area code in parentheses (`(555) 123-4567`),
  or has three groups of 2–4 digits or more and at least 9 digits (`555-123-4567`) — a date alone
  (2024-01-15, 15.01.2024) has 8. Not: three groups in a row that read as a date (a year 1900–2099
  first or last, the others ≤ 31: "2024-01-15 10:30"), groups of exactly three digits after the first
  (thousands: 100 000 000), four dotted groups of ≤ 3 digits (an address or version), or a number
  after a version word. Local numbers without an area code (555-1234) are not caught: too like
  other numbers.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections import Counter

from ultratron.curation.frame import StageContext

PLACEHOLDERS = {"email": "<EMAIL>", "ip": "<IP_ADDRESS>", "phone": "<PHONE>"}
REASON = "pii"

_EMAIL = re.compile(r"(?<![\w.%+-])[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@"
                    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,24}(?![\w-])")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\w|\.\d)")
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|:|(?:\d{1,3}\.){3}\d{1,3})?"
                   r"(?![\w:]|\.\d)")
# +CC, an optional area code (in parentheses or not), then groups of 2–8 digits; or without a country
# code, an optional area code in parentheses and groups of 2–4 digits
_PHONE = re.compile(r"(?<![\w+.\-/])(?:\+\d{1,3}(?:[ .\-]?\(?\d{1,5}\)?)?(?:[ .\-]\d{2,8}){1,5}"
                    r"|(?:\(\d{1,4}\)[ .\-]?)?\d{2,4}(?:[ .\-]\d{2,4}){1,4})(?![\w\-/]|\.\d)")
_VERSION_BEFORE = re.compile(r"(?i)(?<![a-z])(?:version|release|build|revision|rev|ver)[\W_]{0,8}$|(?<![A-Za-z])v$")
_GROUP = re.compile(r"\d+")


def _after_version_word(text: str, start: int) -> bool:
    return bool(_VERSION_BEFORE.search(text[max(0, start - 24):start]))


def public_ip(candidate: str) -> bool:
    """Whether `candidate` is an IPv4/IPv6 address that is public (see the module docstring)."""
    try:
        ip = ipaddress.ip_address(candidate)
    except ValueError:
        return False
    return ip.is_global and not (ip.is_private or ip.is_reserved or ip.is_loopback or ip.is_link_local
                                 or ip.is_multicast or ip.is_unspecified)


def _holds_date(groups: list[str]) -> bool:
    """Three groups in a row that read as a date: a year 1900–2099 first or last, the others ≤ 31."""
    for i in range(len(groups) - 2):
        a, b, c = groups[i:i + 3]
        for year, rest in ((a, (b, c)), (c, (a, b))):
            if len(year) == 4 and 1900 <= int(year) <= 2099 and all(int(g) <= 31 for g in rest):
                return True
    return False


def is_phone(candidate: str) -> bool:
    """Whether a match of the phone pattern is a phone number by the rules of the module docstring."""
    groups = _GROUP.findall(candidate)
    digits = sum(map(len, groups))
    if not 7 <= digits <= 15:
        return False
    prefixed = candidate.startswith(("+", "("))
    if not prefixed and (len(groups) < 3 or digits < 9 or _holds_date(groups)):
        return False
    if not prefixed and len(groups[0]) <= 3 and all(len(g) == 3 for g in groups[1:]):
        return False  # thousands
    return not (len(groups) == 4 and "." in candidate and all(len(g) <= 3 for g in groups))


def scrub(text: str, kinds=tuple(PLACEHOLDERS)) -> tuple[str, Counter]:
    """`text` with the personal data of `kinds` replaced, and the replacements per kind."""
    counts: Counter = Counter()

    def replace(kind: str, keep):
        def fn(m: re.Match) -> str:
            if keep(m):
                return m.group()
            counts[kind] += 1
            return PLACEHOLDERS[kind]
        return fn

    if "email" in kinds and "@" in text:
        text = _EMAIL.sub(replace("email", lambda m: False), text)
    if "ip" in kinds:
        not_ip = lambda m: not public_ip(m.group()) or _after_version_word(m.string, m.start())
        if "." in text:
            text = _IPV4.sub(replace("ip", not_ip), text)
        if "::" in text or text.count(":") >= 7:
            text = _IPV6.sub(replace("ip", lambda m: not public_ip(m.group())), text)
    if "phone" in kinds:
        text = _PHONE.sub(replace("phone", lambda m: not is_phone(m.group()) or _after_version_word(m.string,
                                                                                                  m.start())), text)
    return text, counts


def make_doc_fn(cfg, side):
    kinds = tuple(cfg.pii.kinds)

    def fn(record: dict, index: int):
        text, counts = scrub(record["text"], kinds)
        if not counts:
            return record, None, None, None
        return {**record, "text": text}, REASON, None, dict(counts)

    return fn


def run(ctx: StageContext) -> dict:
    ctx.map_parts(make_doc_fn)
    total: Counter = Counter()
    for path in sorted((ctx.out_dir / "_decisions").glob("*.jsonl")):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                entry = json.loads(line)
                if entry["reason"] == REASON:
                    total.update(entry["detail"])
    return {"pii_replaced": {kind: total.get(kind, 0) for kind in ctx.cfg.pii.kinds}}
