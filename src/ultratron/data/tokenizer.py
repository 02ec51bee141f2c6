"""Byte-level BPE tokenizer, trained with Hugging Face `tokenizers` and saved as tokenizer.json.

Byte-level means every UTF-8 string maps to tokens and back exactly: the base alphabet is the
256 bytes, so no text is ever unknown. Encoding goes through `tiktoken` where that is proven to
give the same ids (`data/fast_bpe.py`, checked on first use), else through `tokenizers`.

A tokenizer imported with a Hugging Face model keeps what Hugging Face keeps beside tokenizer.json
in tokenizer_config.json — its end-of-text token, its BOS token, its chat template — and is saved
with that file again, so a checkpoint of it stays self-contained.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from ultratron import atomic
from ultratron.data.fast_bpe import DIGIT_GROUPS_PATTERN, FastBPE, fast_encoder
from ultratron.errors import DataError

EOS_TOKEN = "<|endoftext|>"
CONFIG_FILE = "tokenizer_config.json"  # Hugging Face's name for the settings beside tokenizer.json
TEMPLATE_FILE = "chat_template.jinja"  # newer transformers write the chat template here


def _token_text(value) -> str | None:
    """tokenizer_config.json names tokens as strings or as {"content": ...} objects."""
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """A thin wrapper that keeps the few things ultratron needs in one place."""

    def __init__(self, hf: HFTokenizer, eos_token: str = EOS_TOKEN, bos_token: str | None = None,
                 chat_template: str | None = None):
        self.hf = hf
        eos = hf.token_to_id(eos_token)
        if eos is None:
            raise DataError(f"tokenizer has no {eos_token!r} token; train it with ultratron or add one")
        if bos_token is not None and hf.token_to_id(bos_token) is None:
            raise DataError(f"tokenizer has no {bos_token!r} token, which its config names as the BOS token")
        self.eos_id, self.eos_token, self.bos_token, self.chat_template = eos, eos_token, bos_token, chat_template
        self._fast: FastBPE | None = None
        self.fast_reason: str | None = None  # why the fast encoder is not used; None: not checked yet

    @property
    def fast(self) -> FastBPE | None:
        """The tiktoken encoder with this tokenizer's ids, or None (then `fast_reason` says why)."""
        if self.fast_reason is None:
            self._fast, self.fast_reason = fast_encoder(self.hf)
        return self._fast

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids per text, encoded in parallel: by tiktoken where it gives the same ids (about
        4× faster here), else by `tokenizers`, whose `encode_batch_fast` (≥ 0.20) skips the
        character offsets, half the time on byte-level BPE; older versions use `encode_batch`."""
        if self.fast is not None and (ids := self.fast.encode_batch(texts)) is not None:
            return ids
        encode = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def to_json(self) -> str:
        return self.hf.to_str()

    def config_json(self) -> str | None:
        """tokenizer_config.json, or None for ultratron's own tokenizers (which need none)."""
        if self.eos_token == EOS_TOKEN and self.bos_token is None and self.chat_template is None:
            return None
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos_token,
                  "bos_token": self.bos_token, "chat_template": self.chat_template}
        return json.dumps({k: v for k, v in config.items() if v is not None}, indent=2) + "\n"

    def files(self) -> dict[str, str]:
        """The files that make up this tokenizer (for a checkpoint directory)."""
        config = self.config_json()
        return {"tokenizer.json": self.to_json(), **({CONFIG_FILE: config} if config else {})}

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for name, text in sorted(self.files().items(), key=lambda f: f[0] == "tokenizer.json"):  # it last
            target = path if name == "tokenizer.json" else path.with_name(name)
            atomic.write_text(target, text)

    @classmethod
    def load(cls, path: str | Path, eos_token: str | None = None) -> Tokenizer:
        """tokenizer.json, with the tokenizer_config.json (and chat_template.jinja) beside it if any.
        `eos_token` is the fallback when the config names none (e.g. from a model's config.json)."""
        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenizer file {str(path)!r} does not exist")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception on malformed files
            raise DataError(f"{path}: not a valid tokenizer.json ({err})") from None
        config = cls._read_config(path.with_name(CONFIG_FILE))
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if template is None and path.with_name(TEMPLATE_FILE).is_file():
            template = path.with_name(TEMPLATE_FILE).read_text(encoding="utf-8")
        eos = _token_text(config.get("eos_token")) or eos_token
        if eos is None and hf.token_to_id(EOS_TOKEN) is None:
            raise DataError(f"{path}: no end-of-text token: neither {CONFIG_FILE} nor the model's config names one, "
                            f"and the vocabulary has no {EOS_TOKEN!r}")
        return cls(hf, eos or EOS_TOKEN, _token_text(config.get("bos_token")), template)

    @staticmethod
    def _read_config(path: Path) -> dict:
        if not path.is_file():
            return {}
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(config, dict):
            raise DataError(f"{path}: expected a JSON object")
        return config


def pre_tokenizer(split_digits: bool = True):
    """GPT-2's byte-level pre-tokenizer; with `split_digits`, its regex with numbers cut into groups of at
    most three digits (Llama 3's `p{N}{1,3}` regex, `fast_bpe.DIGIT_GROUPS_PATTERN`): "1234567" is three
    pre-tokens, 123 456 7, so a number's tokens follow its digits, and no merge joins a space to them."""
    if not split_digits:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(DIGIT_GROUPS_PATTERN), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
                    split_digits: bool = True) -> Tokenizer:
    """Train byte-level BPE with `vocab_size` entries (including the 256 bytes and EOS); numbers in
    groups of at most three digits unless `split_digits` is False (`pre_tokenizer`). A tokenizer.json
    loaded keeps the pre-tokenizer it was trained with."""
    if vocab_size < 257 + 1:
        raise DataError(f"vocab_size={vocab_size} is too small: byte-level BPE needs at least 258 entries")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizer(split_digits)
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
