"""`response_format: {"type": "json_object"}` by constrained decoding: at every step, tokens whose
bytes cannot continue a JSON object are masked out before sampling, and once the object is closed
only the end-of-text token remains, so the completion is one valid JSON object (unless max_tokens
or a stop string cuts it first, as with OpenAI's API: finish_reason then says so).

The check runs on bytes, which is what a byte-level BPE's tokens are: JSON's structure is ASCII,
and a byte ≥ 0x80 (part of a multi-byte character, split across tokens or not) may only appear
inside a string. A pushdown automaton over bytes: the stack of open containers and a mode. The
mask for a state is computed once over the vocabulary (each token's bytes run through the
automaton, in byte order, so a prefix shared by many tokens is checked once and a failing one skips
them all) and cached by state, so long strings, whose state repeats, cost one lookup a token.
Whitespace is allowed inside the object, up to MAX_BLANKS bytes in a row, so the model cannot pad
it forever; the text starts with "{" and ends with the "}" that closes it. json_schema is not done
this way (it needs a grammar from the schema): refused.
"""

from __future__ import annotations

from bisect import bisect_left

import torch

MAX_BLANKS = 16
MAX_MASKS = 1024  # cached masks (a 128k vocabulary's is 128 kB)
BLANK = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")
LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}

# A state: (stack of open containers as bytes, mode, detail). Modes: "value" (a value must come),
# "value]" (a value or "]": just after "["), "key}" (a key or "}": just after "{"), "key", ":",
# "after" (after a value: "," or a closer), "str"/"key-str" (inside a string), "esc", "u" (detail:
# hex digits left), "lit" (detail: the literal's remaining bytes), "num" (detail: number state),
# "done" (the object is closed). Blank runs are counted in the detail of the modes that allow them.
State = tuple[bytes, str, object]
START: State = (b"", "value", 0)


def step(state: State, byte: int) -> State | None:
    """The state after `byte`, or None when no JSON object can continue this way."""
    stack, mode, detail = state
    if mode in ("str", "key-str"):
        if byte == ord('"'):
            return (stack, ":", 0) if mode == "key-str" else (stack, "after", 0)
        if byte == ord("\\"):
            return (stack, "esc", mode)
        return None if byte < 0x20 else state
    if mode == "esc":
        if byte == ord("u"):
            return (stack, "u", (detail, 4))
        return (stack, detail, None) if byte in b'"\\/bfnrt' else None
    if mode == "u":
        back, left = detail
        if byte not in HEX:
            return None
        return (stack, back, None) if left == 1 else (stack, "u", (back, left - 1))
    if mode == "lit":
        if byte != detail[0]:
            return None
        return (stack, "after", 0) if len(detail) == 1 else (stack, "lit", detail[1:])
    if mode == "num":
        after = _number(detail, byte)
        if after is not None:
            return (stack, "num", after)
        if detail not in ("0", "int", "frac", "exp"):  # the number is incomplete
            return None
        return step((stack, "after", 0), byte)
    if byte in BLANK:
        if mode == "done" or detail >= MAX_BLANKS or not stack:  # the object starts and ends the text
            return None
        return (stack, mode, detail + 1)
    if mode in ("value", "value]"):
        if mode == "value]" and byte == ord("]"):
            return _close(stack, ord("]"))
        if not stack:  # the top level: an object, nothing else
            return (b"{", "key}", 0) if byte == ord("{") else None
        if byte == ord("{"):
            return (stack + b"{", "key}", 0)
        if byte == ord("["):
            return (stack + b"[", "value]", 0)
        if byte == ord('"'):
            return (stack, "str", None)
        if byte in LITERALS:
            return (stack, "lit", LITERALS[byte])
        if byte == ord("-"):
            return (stack, "num", "-")
        if byte in DIGITS:
            return (stack, "num", "0" if byte == ord("0") else "int")
        return None
    if mode in ("key}", "key"):
        if mode == "key}" and byte == ord("}"):
            return _close(stack, ord("}"))
        return (stack, "key-str", None) if byte == ord('"') else None
    if mode == ":":
        return (stack, "value", 0) if byte == ord(":") else None
    if mode == "after":
        if byte == ord(","):
            return (stack, "key" if stack[-1:] == b"{" else "value", 0)
        return _close(stack, byte)
    return None  # "done": nothing more


def _close(stack: bytes, byte: int) -> State | None:
    want = {ord("}"): b"{", ord("]"): b"["}.get(byte)
    if want is None or stack[-1:] != want:
        return None
    rest = stack[:-1]
    return (rest, "after", 0) if rest else (b"", "done", 0)


def _number(at: str, byte: int) -> str | None:
    """JSON's number grammar: -? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?"""
    digit = byte in DIGITS
    moves = {"-": "0" if byte == ord("0") else ("int" if digit else None),
             "0": "." if byte == ord(".") else ("e" if byte in b"eE" else None),
             "int": "int" if digit else ("." if byte == ord(".") else ("e" if byte in b"eE" else None)),
             ".": "frac" if digit else None,
             "frac": "frac" if digit else ("e" if byte in b"eE" else None),
             "e": "exp" if digit else ("sign" if byte in b"+-" else None),
             "sign": "exp" if digit else None,
             "exp": "exp" if digit else None}
    return moves[at]


def run(state: State | None, data: bytes) -> State | None:
    for byte in data:
        if state is None:
            return None
        state = step(state, byte)
    return state


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer, vocab_size: int) -> list[bytes | None] | None:
    """Each token id's bytes (None for special tokens); None when the tokenizer is not byte-level."""
    decoder = byte_decoder()
    hf = tokenizer.hf
    special = {t.content for t in hf.get_added_tokens_decoder().values()}
    out: list[bytes | None] = []
    for i in range(vocab_size):
        piece = hf.id_to_token(i)
        if piece is None or piece in special:
            out.append(None)
        elif all(c in decoder for c in piece):
            out.append(bytes(decoder[c] for c in piece))
        else:
            return None
    return out


class Grammar:
    """An automaton over bytes: `step(state, byte)` (None: refused), `done(state)`: only the end may
    follow, `in_string(state)`: inside a JSON string, where any byte but '"', '\\' and controls goes."""

    def __init__(self, key: str, start, step, done, in_string):
        self.key, self.start, self.step, self.done, self.in_string = key, start, step, done, in_string

    def run(self, state, data: bytes):
        for byte in data:
            if state is None:
                return None
            state = self.step(state, byte)
        return state


OBJECT = Grammar("json_object", START, step, lambda s: s[1] == "done", lambda s: s[1] in ("str", "key-str"))


class JsonVocabulary:
    """A tokenizer's tokens as bytes, and the mask of tokens allowed in each grammar state (cached:
    shared by every request; masks are computed by the worker thread only)."""

    def __init__(self, pieces: list[bytes | None], eos_id: int):
        self.pieces, self.eos_id = pieces, eos_id
        self._masks: dict[tuple, torch.Tensor] = {}
        # the tokens in byte order: those sharing a prefix are a run, so one walk through the automaton
        # checks a prefix once for all of them and skips the whole run when it fails (a trie, as a list)
        self._order = sorted((i for i, p in enumerate(pieces) if p), key=lambda i: pieces[i])
        self._keys = [pieces[i] for i in self._order]
        # inside a string, a token without '"', '\\' or control bytes always continues it
        self._plain = [bool(p) and not any(b < 0x20 or b in b'"\\' for b in p) for p in pieces]
        self._others = [i for i, p in enumerate(pieces) if p and not self._plain[i]]

    def allowed(self, state, grammar: Grammar = OBJECT) -> torch.Tensor:
        key = (grammar.key, state)
        if key not in self._masks:
            ok = [False] * len(self.pieces)
            if grammar.done(state):
                ok[self.eos_id] = True
            elif grammar.in_string(state):
                ok = list(self._plain)
                for i in self._others:
                    ok[i] = grammar.run(state, self.pieces[i]) is not None
            else:
                self._walk(grammar, state, 0, len(self._keys), 0, ok)
            ok = torch.tensor(ok, dtype=torch.bool)
            if not ok.any():  # no token continues (cannot happen with all 256 bytes as tokens): end it
                ok[self.eos_id] = True
            if len(self._masks) >= MAX_MASKS:  # bounded: the oldest state's mask goes
                self._masks.pop(next(iter(self._masks)))
            self._masks[key] = ok
        return self._masks[key]

    def _walk(self, grammar: Grammar, state, lo: int, hi: int, depth: int, ok: list[bool]) -> None:
        """Mark the tokens keys[lo:hi], which share their first `depth` bytes (leaving the automaton in
        `state`), that it accepts whole."""
        keys, i = self._keys, lo
        while i < hi and len(keys[i]) == depth:  # the prefix itself is a token: it sorts first
            ok[self._order[i]] = True
            i += 1
        while i < hi:
            byte = keys[i][depth]
            end = hi if byte == 255 else bisect_left(keys, keys[i][:depth] + bytes([byte + 1]), i, hi)
            after = grammar.step(state, byte)
            if after is not None:
                self._walk(grammar, after, i, end, depth + 1, ok)
            i = end


class JsonConstraint:
    """One sequence's constraint (SamplingParams.constrain): follows its tokens through `grammar`."""

    def __init__(self, vocab: JsonVocabulary, grammar: Grammar = OBJECT):
        self.vocab, self.grammar = vocab, grammar
        self.seen, self.state = 0, grammar.start

    def __call__(self, ids: list[int], scores: torch.Tensor) -> torch.Tensor:
        pieces = self.vocab.pieces
        for i in ids[self.seen:]:
            piece = pieces[i] if 0 <= i < len(pieces) else None
            self.state = None if piece is None or self.state is None else self.grammar.run(self.state, piece)
        self.seen = len(ids)
        if self.state is None:  # only a token this mask refused gets here; let the sequence end
            allowed = torch.zeros(len(pieces), dtype=torch.bool)
            allowed[self.vocab.eos_id] = True
        else:
            allowed = self.vocab.allowed(self.state, self.grammar)
        if allowed.shape[-1] < scores.shape[-1]:  # the model's vocabulary pads the tokenizer's
            allowed = torch.cat([allowed, allowed.new_zeros(scores.shape[-1] - allowed.shape[-1])])
        return scores.masked_fill(~allowed[: scores.shape[-1]], float("-inf"))
