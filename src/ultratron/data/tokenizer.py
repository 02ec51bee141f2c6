"""Byte-level BPE tokenizer, trained with Hugging Face `tokenizers` and saved as tokenizer.json.

Byte-level means every UTF-8 string maps to tokens and back exactly: the base alphabet is the
256 bytes, so no text is ever unknown.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ultratron.errors import DataError

EOS_TOKEN = "<|endoftext|>"


class Tokenizer:
    """A thin wrapper that keeps the few things ultratron needs in one place."""

    def __init__(self, hf: HFTokenizer):
        self.hf = hf
        eos = hf.token_to_id(EOS_TOKEN)
        if eos is None:
            raise DataError(f"tokenizer has no {EOS_TOKEN!r} token; train it with ultratron or add one")
        self.eos_id = eos

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids per text, encoded in parallel by the Rust library. `encode_batch_fast`
        (tokenizers ≥ 0.20) gives the same ids without computing character offsets, which
        took half the time on byte-level BPE; older versions fall back to `encode_batch`."""
        encode = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def to_json(self) -> str:
        return self.hf.to_str()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json(), encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenizer file {str(path)!r} does not exist")
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as err:  # tokenizers raises a bare Exception on malformed files
            raise DataError(f"{path}: not a valid tokenizer.json ({err})") from None


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Train byte-level BPE with `vocab_size` entries (including the 256 bytes and EOS)."""
    if vocab_size < 257 + 1:
        raise DataError(f"vocab_size={vocab_size} is too small: byte-level BPE needs at least 258 entries")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(hf)
