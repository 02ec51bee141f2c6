"""Echoed logprobs' `text_offset` (`Server.offsets`): a prompt sent as token ids gets the offsets the
same text sent as a string gets, at the cost of one encoding rather than a decoding per token (lm-eval
sends ids; a 1,000-token prompt was ~1,000 decodings); ids that do not come back from encoding their
text keep the length of each prefix's decoding."""

from __future__ import annotations

import pytest

from ultratron.serving.server import Server

from .serving import corpus_tokenizer


class _Counting:
    """The tokenizer, counting its decodings."""

    def __init__(self, tokenizer):
        self.inner, self.hf, self.decodes = tokenizer, tokenizer.hf, 0

    def decode(self, ids):
        self.decodes += 1
        return self.inner.decode(ids)


class _Host:  # what `Server.offsets` reads of its server
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer


@pytest.fixture(scope="module")
def tokenizer(small_corpus):
    return corpus_tokenizer(small_corpus)


@pytest.mark.parametrize("text", ["def total(values):\n    return sum(v * 2 for v in values)\n",
                                  "naïve café — ünïcode ✓ 日本語 text", "  \tleading spaces\n\n"])
def test_token_id_prompts_get_the_string_prompts_offsets_from_one_encoding(tokenizer, text):
    host = _Host(_Counting(tokenizer))
    ids = tokenizer.encode(text)
    assert len(ids) > 5
    as_string = Server.offsets(host, text, ids, from_string=True)
    as_ids = Server.offsets(host, tokenizer.decode(ids), ids, from_string=False)
    assert as_ids == as_string and host.tokenizer.decodes == 0
    assert as_ids[0] == 0 and as_ids == sorted(as_ids) and as_ids[-1] < len(text)


def test_ids_that_do_not_encode_back_keep_each_prefixs_decoded_length(tokenizer):
    host = _Host(_Counting(tokenizer))
    text = "return values"
    ids = [i for ch in text for i in tokenizer.encode(ch)]  # one token a character: not how it encodes
    assert ids != tokenizer.encode(text)
    offsets = Server.offsets(host, tokenizer.decode(ids), ids, from_string=False)
    assert offsets == [len(tokenizer.decode(ids[:i])) for i in range(len(ids))] == list(range(len(text)))
    assert host.tokenizer.decodes == len(ids)
