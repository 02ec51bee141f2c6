"""The tiktoken encoder gives Hugging Face's ids, and is refused where it would not."""

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ultratron.data.fast_bpe import byte_to_unicode
from ultratron.data.sources import iter_documents
from ultratron.data.tokenizer import EOS_TOKEN, Tokenizer, train_tokenizer

VARIED = [
    "def f(x):\n    return {'a': x ** 2, \"b\": [1, 2, 3]}  # comment\r\n\tif a != b:\n\t\tpass\n",
    "Grüße aus Köln — naïve café, Ελληνικά, русский текст, العربية, עברית, हिन्दी, 中文文本, 日本語のテキスト, 한국어",
    "∀x ∈ ℝ: x² ≥ 0, ∑ᵢ aᵢ ≤ ∞, ∫₀¹ f(t) dt = ½, e^{iπ} + 1 = 0, 1e-9 ≈ 0.000000001",
    "   leading, trailing   \n\n\n    \t \t  \u00a0\u2003\u200b\u3000 between  words   \n ",
    "control \x00\x01\x02\x1b[31mred\x1b[0m \x7f \x85 \u2028\u2029 \ufeff end",
    "emoji 😀👍🏽👨‍👩‍👧‍👦 🇩🇪 flags, e\u0301 combining, ﬁ ligature, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "a" * 3000, " " * 500, "ab" * 1500, "\n" * 300, "😀" * 200, "1234567890" * 100,
    f"one document{EOS_TOKEN}the next{EOS_TOKEN}{EOS_TOKEN} and one more",
    "I'll we've they're it's don't 'S 'LL", "", " ", "x",
]


def every_code_point(step: int = 1, start: int = 0, stop: int = 0x10000) -> list[str]:
    """Each code point (no surrogates) in letter, digit, space and punctuation contexts."""
    chars = [chr(c) for c in range(start, stop, step) if not 0xD800 <= c < 0xE000]
    return ["".join(f"{c}a{c} {c}1{c}{c}.{c}\n" for c in chars[i:i + 256]) for i in range(0, len(chars), 256)]


def hf_ids(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.hf.encode_batch(texts, add_special_tokens=False)]


@pytest.fixture(scope="module")
def trained(small_corpus) -> Tokenizer:
    docs = [d.text for d in iter_documents(str(small_corpus), ".py")] + VARIED * 3
    return train_tokenizer(docs, vocab_size=1200)


def test_same_ids_as_hugging_face_on_varied_text(trained):
    assert trained.fast is not None, trained.fast_reason
    texts = VARIED + every_code_point() + every_code_point(step=97, start=0x10000, stop=0x110000)
    ids = trained.encode_batch(texts)
    assert ids == hf_ids(trained, texts)
    assert sum(map(len, ids)) > 500_000  # real work was compared


def test_same_ids_with_add_prefix_space(small_corpus):
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator([d.text for d in iter_documents(str(small_corpus), ".py")] + VARIED,
                           trainers.BpeTrainer(vocab_size=800, special_tokens=[EOS_TOKEN], show_progress=False,
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = Tokenizer(hf)
    assert tok.fast is not None and tok.fast.prefix_space, tok.fast_reason
    assert tok.encode_batch(VARIED) == hf_ids(tok, VARIED)  # (the EOS text goes to HF: spaces per piece)
    plain = [t for t in VARIED if EOS_TOKEN not in t]
    assert tok.fast.encode_batch(plain) == hf_ids(tok, plain)


def bpe(merges: list[tuple[str, str]]) -> HFTokenizer:
    """A byte-level BPE over the 256 bytes, EOS and these merges in this order."""
    alphabet = sorted(byte_to_unicode().values())
    vocab = {EOS_TOKEN: 0} | {c: i + 1 for i, c in enumerate(alphabet)}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    hf = HFTokenizer(models.BPE(vocab, merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([EOS_TOKEN])
    return hf


def test_refused_where_tiktoken_would_differ():
    # "abc" is a token, but HF merges b+c first and has no merge a+bc: it encodes "abc" as a, bc,
    # while rank-of-concatenation BPE (tiktoken) would merge a+bc into abc.
    tok = Tokenizer(bpe([("b", "c"), ("a", "b"), ("ab", "c")]))
    assert tok.fast is None and "'abc' does not merge into itself" in tok.fast_reason
    assert tok.encode("abc xabc") == hf_ids(tok, ["abc xabc"])[0] and len(tok.encode("abc")) == 2
    fine = Tokenizer(bpe([("a", "b"), ("b", "c"), ("ab", "c")]))
    assert fine.fast is not None, fine.fast_reason
    assert fine.encode("abc xabc bca") == hf_ids(fine, ["abc xabc bca"])[0]


def test_refused_for_merges_out_of_rank_order_and_other_pre_tokenizers(trained):
    spec = json.loads(trained.to_json())
    spec["model"]["merges"][3], spec["model"]["merges"][4] = spec["model"]["merges"][4], spec["model"]["merges"][3]
    swapped = Tokenizer(HFTokenizer.from_str(json.dumps(spec)))
    assert swapped.fast is None and "rank order" in swapped.fast_reason
    assert swapped.encode_batch(VARIED) == hf_ids(swapped, VARIED)
    spec = json.loads(trained.to_json())
    spec["normalizer"] = {"type": "NFC"}
    assert Tokenizer(HFTokenizer.from_str(json.dumps(spec))).fast is None
