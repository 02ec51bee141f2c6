"""`serve --dtype bf16`: the server's echoed log-probabilities stay within the bf16 bound of fp32's.

The bound (tests/tolerances.py, SERVING_BF16) is derived from bf16's 8 significant bits and the
model's size: 2·2^-8·√(8L + 2)·max|h|·max_j|w_j|, with L layers, h the final normed hidden state and
w_j the output head's rows, both measured on the fp32 model. The model is a small random one whose
head is scaled up so that its log-probabilities spread over several nats, as a trained model's do
(a random model's are all near −log V, where any error looks small)."""

import copy

import pytest
import torch

from tolerances import bf16_logprob_bound

from .serving import call, corpus_tokenizer, running_server, small_model

PROMPTS = ["def add(a, b):\n    return a + b\n", "import os\nimport sys\n", "class Point:\n    x: int\n"]


def _echo(url, tokenizer):
    """Each prompt's token log-probabilities and top-5 alternatives, as lm-eval asks for them."""
    out = []
    for prompt in PROMPTS:
        status, body = call(url, "/v1/completions", {"model": "ultratron", "prompt": [tokenizer.encode(prompt)],
                                                     "max_tokens": 0, "echo": True, "logprobs": 5})
        assert status == 200, body
        out.append(body["choices"][0]["logprobs"])
    return out


def test_bf16_logprobs_are_within_the_derived_bound_of_fp32(small_corpus):
    tokenizer = corpus_tokenizer(small_corpus)
    model = small_model()
    model.output.weight.mul_(8)  # log-probabilities over several nats, as a trained model's
    hidden = []
    hook = model.norm.register_forward_hook(lambda module, args, out: hidden.append(out.norm(dim=-1).max()))
    with running_server(model, tokenizer) as (url, _):
        fp32 = _echo(url, tokenizer)
    hook.remove()
    low = copy.deepcopy(model).to(torch.bfloat16)
    assert low.output.weight.dtype == torch.bfloat16
    with running_server(low, tokenizer) as (url, server):
        assert server.batcher.engine.cache.keys[next(iter(server.batcher.engine.cache.keys))].dtype == torch.bfloat16
        bf16 = _echo(url, tokenizer)
    bound = bf16_logprob_bound(model.args.n_layers, float(max(hidden)), float(model.output.weight.norm(dim=-1).max()))
    gaps, spread = [], []
    for a, b in zip(fp32, bf16, strict=True):
        assert a["tokens"] == b["tokens"]
        gaps += [abs(x - y) for x, y in zip(a["token_logprobs"][1:], b["token_logprobs"][1:], strict=True)]
        spread += a["token_logprobs"][1:]
        for top_a, top_b in zip(a["top_logprobs"][1:], b["top_logprobs"][1:], strict=True):
            if len(top_a) == len(top_b) == 5:  # keyed by text: two tokens that decode alike ("\ufffd") share a key
                gaps += [abs(lp - top_b[t]) for t, lp in top_a.items() if t in top_b]
    print(f"bf16 against fp32: largest logprob gap {max(gaps):.4f} nats over {len(gaps)} values, bound {bound:.4f} "
          f"(logprobs span {min(spread):.1f}..{max(spread):.1f})")
    assert min(spread) < -5, "the log-probabilities spread over several nats"
    assert max(gaps) <= bound
    assert max(gaps) > 0, "the second server really computed in bf16"


def test_the_default_dtype_is_bf16_on_a_gpu_and_fp32_on_a_cpu():
    from ultratron.checkpoint.inference import inference_dtype
    from ultratron.errors import CheckpointError

    assert inference_dtype(None, "cpu") == torch.float32 and inference_dtype(None, "cuda:0") == torch.bfloat16
    assert inference_dtype("fp32", "cuda") == torch.float32 and inference_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(CheckpointError, match="fp16"):
        inference_dtype("fp16", "cpu")


def test_a_trained_checkpoint_loads_in_bf16_within_the_bound(trained_checkpoint):
    """`load_for_inference(dtype=bf16)`, as `serve --dtype bf16` calls it, on the trained checkpoint:
    every weight bf16, and the log-probabilities of every position within the same derived bound."""
    from ultratron.checkpoint.inference import load_for_inference

    fp32 = load_for_inference(trained_checkpoint)
    bf16 = load_for_inference(trained_checkpoint, dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}
    ids = torch.tensor([fp32.tokenizer.encode("def add(a, b):\n    return a + b\n\nclass Point:\n")])
    hidden = []
    hook = fp32.model.norm.register_forward_hook(lambda module, args, out: hidden.append(out.norm(dim=-1).max()))
    with torch.no_grad():
        want = torch.log_softmax(fp32.model(ids).float(), -1)
        got = torch.log_softmax(bf16.model(ids).float(), -1)
    hook.remove()
    model = fp32.model
    bound = bf16_logprob_bound(model.args.n_layers, float(hidden[0]), float(model.output.weight.norm(dim=-1).max()))
    gap = float((got - want).abs().max())
    print(f"trained checkpoint, bf16 against fp32: largest gap {gap:.4f} nats over the whole vocabulary, "
          f"bound {bound:.4f}")
    assert 0 < gap <= bound
