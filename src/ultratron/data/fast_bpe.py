"""A faster encoder for byte-level BPE tokenizer.json files: the same ids as Hugging Face
`tokenizers`, from `tiktoken`'s BPE core, used only where that is proven at load.

`tokenizers` spends most of its encoding time on per-character alignment bookkeeping, its
pre-tokenizer regex and allocations (docs/data.md); `tiktoken` splits with a compiled regex and
merges bytes directly, several times faster. The two run different algorithms:

- Hugging Face merges the adjacent pair of lowest *merge* rank, among pairs in the merge list;
- tiktoken merges the adjacent pair whose *concatenation* has the lowest token rank, among pairs
  whose concatenation is in the vocabulary, and emits a pre-token that is itself in the
  vocabulary at once.

They agree on every input when (checked in `fast_encoder`, else it returns None and the caller
keeps `tokenizers`):

1. each merge makes a distinct token whose id grows with the merge's rank and exceeds the ids of
   its two parts (so both apply merges in increasing rank order, with the same priorities, and
   pick the leftmost of equal ones); and
2. every token, encoded alone as one pre-token by Hugging Face, comes out as itself.

Why 2 suffices: the pairs tiktoken could merge but Hugging Face would not are those (x, y) not in
the merge list whose concatenation t is a token. If x and y were ever adjacent while encoding
some pre-token, no merge would have crossed the span of t, so the merges inside it would have
been exactly those of encoding t alone, which would then pass through the state [x, y] — and end
there, not at [t]. So by 2 no such pair is ever adjacent, both algorithms see the same candidate
pairs at every step and make the same choice, and a pre-token that is a token is reached by the
merges too. The rest must match as configured: no normalizer, the ByteLevel pre-tokenizer with
GPT-2's split regex (`add_prefix_space` honoured) or a Split on a regex (isolated pieces) followed
by ByteLevel without its regex, which tiktoken applies as the same regex (ultratron's tokenizers
split digits this way, `DIGIT_GROUPS_PATTERN`), plain BPE options, added tokens that are
special, matched whole on the raw text. A short probe of varied text (scripts, whitespace and
control characters) is compared at load as well, for the regex engines' character classes.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

# The split regex of Hugging Face's ByteLevel pre-tokenizer (GPT-2's, Radford et al. 2019).
BYTE_LEVEL_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# GPT-2's regex with numbers cut into groups of at most three digits and no space joined to them, as
# Llama 3's pre-tokenizer does (`\p{N}{1,3}`); ultratron trains its tokenizers with it (`DIGIT_GROUPS`):
# a Split on it, then ByteLevel without its own regex.
DIGIT_GROUPS_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def split_pattern(pre: dict) -> tuple[str | None, bool, str]:
    """(the tiktoken split regex that gives the pre-tokenizer's pieces, add_prefix_space, "") for the two
    supported forms — ByteLevel with its GPT-2 regex; Sequence[Split(regex, isolated), ByteLevel without
    regex] — else (None, False, why not)."""
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return BYTE_LEVEL_PATTERN, bool(pre.get("add_prefix_space")), ""
    steps = pre.get("pretokenizers") or []
    if pre.get("type") == "Sequence" and len(steps) == 2:
        split, level = steps
        regex = (split.get("pattern") or {}).get("Regex")
        if (split.get("type") == "Split" and regex is not None and split.get("behavior") == "Isolated"
                and not split.get("invert") and level.get("type") == "ByteLevel" and not level.get("use_regex", True)
                and not level.get("add_prefix_space")):
            return regex, False, ""
    return None, False, f"pre-tokenizer {pre.get('type')} is neither ByteLevel with its regex nor a regex Split " \
                        "then ByteLevel"

PROBE = ("Hello, world! It's 3.14159 — naïve café; I'll we've they're. \t\n\n  x  \n"
         "def f(x):\n    return x ** 2  # comment\r\n\tif a != b: pass\n"
         "Привет мир. 你好，世界。こんにちは。안녕하세요. مرحبا بالعالم. שלום. नमस्ते. ภาษาไทย\n"
         "∑ᵢ xᵢ² ≤ ∞, α+β=γ; ½ ⅓ ² ١٢٣ 𝟙𝟚 1234567 x=12,345.6789 v1.2.3 2024-01-15 0x1F "
         "😀👍🏽 👨‍👩‍👧 e\u0301 \u00a0\u1680\u2000\u2009\u200b\u2028\u2029\u202f"
         "\u205f\u3000\ufeff\u180e\u0085\x00\x01\x1b[0m\x7f   \n\n\n\t\t  end" + "a" * 300 + " " * 70)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map, which byte-level BPE vocabularies are written in:
    printable Latin-1 bytes map to themselves, the other bytes to U+0100 onwards."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class FastBPE:
    """Encodes like the Hugging Face tokenizer it was built from (see `fast_encoder`)."""

    def __init__(self, encoding, specials: frozenset[str], prefix_space: bool):
        self.encoding, self.specials, self.prefix_space = encoding, specials, prefix_space
        self.threads = max(1, min(8, os.cpu_count() or 1))
        self._pool, self._pool_pid = None, None

    def encode(self, text: str) -> list[int]:
        if self.prefix_space and text and not text.startswith(" "):
            text = " " + text  # (texts holding a special token never get here: see encode_batch)
        return self.encoding.encode(text, allowed_special=self.specials, disallowed_special=())

    def _encode_all(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_batch(self, texts: list[str]) -> list[list[int]] | None:
        """Ids per text, a share of the texts on each of a thread per core (tiktoken releases the
        GIL); None if Hugging Face must encode this batch itself (a prefix space with a special
        token inside a text: Hugging Face adds the space to every piece between special tokens)."""
        if self.prefix_space and any(s in t for t in texts for s in self.specials):
            return None
        if len(texts) < 2 * self.threads or self.threads == 1:
            return self._encode_all(texts)
        if self._pool_pid != os.getpid():  # a forked worker has none of its parent's threads
            self._pool, self._pool_pid = ThreadPoolExecutor(self.threads), os.getpid()
        shares = [texts[i::self.threads] for i in range(self.threads)]  # (interleaved: even work)
        encoded = list(self._pool.map(self._encode_all, shares))
        out: list[list[int]] = [[]] * len(texts)
        for i, share in enumerate(encoded):
            out[i::self.threads] = share
        return out


def fast_encoder(hf) -> tuple[FastBPE | None, str]:
    """(a `FastBPE` giving the same ids as `hf`, "") or (None, why not)."""
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed"
    spec = json.loads(hf.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE":
        return None, f"model {model.get('type')} is not BPE"
    options = {k: model.get(k) for k in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix")}
    if any(v not in (None, "") for v in options.values()) or model.get("byte_fallback") or model.get("ignore_merges"):
        return None, f"BPE options {options} not supported"
    if spec.get("normalizer") is not None:
        return None, "a normalizer is set"
    pattern, prefix_space, why = split_pattern(pre)
    if pattern is None:
        return None, why
    if (spec.get("post_processor") or {}).get("type", "ByteLevel") != "ByteLevel":
        return None, "a post-processor other than ByteLevel is set"
    added = spec.get("added_tokens") or []
    if any(not a["special"] or a["single_word"] or a["lstrip"] or a["rstrip"] or a["normalized"] for a in added):
        return None, "added tokens that are not plain special tokens"
    to_byte = {c: b for b, c in byte_to_unicode().items()}
    vocab, specials = model["vocab"], {a["content"]: a["id"] for a in added}
    try:
        ranks = {bytes(to_byte[c] for c in token): i for token, i in vocab.items() if token not in specials}
    except KeyError:
        return None, "a vocabulary entry outside the byte alphabet"
    if len(ranks) != len(vocab) - len([s for s in specials if s in vocab]) or any(bytes([b]) not in ranks
                                                                                    for b in range(256)):
        return None, "the vocabulary lacks a byte or repeats one"
    previous = -1
    for merge in model["merges"]:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        ids = [vocab.get(left), vocab.get(right), vocab.get(left + right)]
        if None in ids or not (ids[2] > previous and ids[2] > max(ids[0], ids[1])):
            return None, f"merge {left!r} {right!r} is out of rank order"  # (also: two merges make one token)
        previous = ids[2]
    try:
        encoding = tiktoken.Encoding("ultratron-bpe", pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens=specials)
    except Exception as err:  # noqa: BLE001 — tiktoken's own checks; any failure means: keep HF
        return None, f"tiktoken refused the vocabulary ({err})"
    fast = FastBPE(encoding, frozenset(specials), prefix_space)
    # condition 2: every token alone, as one pre-token (its byte characters), merges into itself
    bad = [token for token, i in vocab.items()
           if token not in specials and [t.id for t in hf.model.tokenize(token)] != [i]]
    if bad:
        return None, f"token {bad[0]!r} does not merge into itself ({len(bad)} such)"
    probe = [PROBE, PROBE[::-1], *PROBE.split("\n"), "<|endoftext|>".join(PROBE.split("\n")[:3])]
    reference = [e.ids for e in hf.encode_batch(probe, add_special_tokens=False)]
    if fast.encode_batch(probe) not in (None, reference):
        return None, "the probe text encodes differently"
    return fast, ""
