"""The perplexity filter's scorer built from a real checkpoint that ultratron trained."""

import random

from ultratron.config import load_config
from ultratron.curation.stages.perplexity import load_scorer
from ultratron.training.trainer import train


def test_scorer_from_a_trained_checkpoint_prefers_text_like_its_training_data(tiny_overrides, small_corpus):
    cfg = load_config(None, tiny_overrides + ["--training.steps", "200", "--eval.interval", "0",
                                              "--training.seq_len", "128", "--training.batch_tokens", "2048",
                                              "--optim.warmup_steps", "10"])
    result = train(cfg, echo=False)
    scorer = load_scorer(str(result.run_dir))  # a run directory: its latest checkpoint is meant
    code = (small_corpus / "textwrap.py").read_text()[:1500]
    words = code.split()
    random.Random(0).shuffle(words)
    shuffled = " ".join(words)  # the same words (so similar tokens), no structure
    ppl_code, ppl_shuffled = scorer([code, shuffled])
    print(f"perplexity: python {ppl_code:.1f}, the same words shuffled {ppl_shuffled:.1f}")
    assert ppl_code < 0.9 * ppl_shuffled
