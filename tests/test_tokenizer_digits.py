"""Numbers in groups of at most three digits (Llama 3's pre-tokenizer) for new tokenizers; tokenizers
trained before keep their pre-tokenizer; the tiktoken encoder gives the same ids for both."""

import re

import pytest

from test_fast_bpe import VARIED, every_code_point, hf_ids
from ultratron.data.sources import iter_documents
from ultratron.data.tokenizer import Tokenizer, train_tokenizer

NUMBERS = ["x = 1234567 + 42", "pi is 3.14159265358979", "on 2024-01-15 at 12:30, v1.2.3, 0x1F2E3D",
           "1,234,567.89 and 1 000 000", "١٢٣٤٥ ٦٧٨ and ５６７８９", "  123  4567\n8901234567890"]


@pytest.fixture(scope="module")
def texts(small_corpus) -> list[str]:
    numbers = " ".join(str(n * 7919 % 10_000_000) for n in range(3000))  # plenty of long numbers to merge
    return [d.text for d in iter_documents(str(small_corpus), ".py")] + VARIED * 3 + [numbers] * 5


def test_no_token_holds_more_than_three_digits_or_a_digit_beside_anything_else(texts):
    tok = train_tokenizer(texts, vocab_size=1500)
    digit_tokens = [t for t in map(tok.decode, ([i] for i in range(tok.vocab_size))) if re.search(r"\d", t)]
    assert digit_tokens and all(re.fullmatch(r"\d{1,3}", t) for t in digit_tokens), digit_tokens[:20]
    assert any(len(t) == 3 for t in digit_tokens)  # the groups of three were merged
    for text in NUMBERS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert [tok.decode([i]) for i in tok.encode("1234567")] == ["123", "456", "7"]


def test_a_tokenizer_trained_before_keeps_its_pre_tokenizer_and_both_encode_fast(texts, tmp_path):
    old = train_tokenizer(texts, vocab_size=1500, split_digits=False)
    old.save(tmp_path / "tokenizer.json")
    loaded = Tokenizer.load(tmp_path / "tokenizer.json")
    assert any(re.fullmatch(r" ?\d{4,}", loaded.decode([i])) for i in range(loaded.vocab_size))  # merged digits
    new = train_tokenizer(texts, vocab_size=1500)
    sample = NUMBERS + VARIED + every_code_point(step=7)
    for tok in (loaded, new):
        assert tok.fast is not None, tok.fast_reason
        assert tok.encode_batch(sample) == hf_ids(tok, sample)
