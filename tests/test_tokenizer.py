from ultratron.data.sources import iter_documents
from ultratron.data.tokenizer import Tokenizer, train_tokenizer

SAMPLES = [
    "def f(x):\n    return x ** 2  # square\n",
    "Grüße aus Köln — naïve café, Ελληνικά, русский текст, العربية, 中文文本, 日本語のテキスト, 한국어",
    "∀x ∈ ℝ: x² ≥ 0, ∑ᵢ aᵢ ≤ ∞ 🙂\t\r\n\x00 trailing   ",
    "",
]


def test_exact_round_trip_on_any_utf8(small_corpus, tmp_path):
    tok = train_tokenizer((d.text for d in iter_documents(str(small_corpus), ".py")), vocab_size=600)
    assert 300 < tok.vocab_size <= 600
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    again = Tokenizer.load(path)
    assert again.sha256 == tok.sha256 and again.encode(SAMPLES[1]) == tok.encode(SAMPLES[1])


def test_bpe_compresses_the_text_it_was_trained_on(small_corpus):
    docs = [d.text for d in iter_documents(str(small_corpus), ".py")]
    tok = train_tokenizer(docs, vocab_size=1000)
    text = docs[0]
    assert len(text.encode()) / len(tok.encode(text)) > 2.0
