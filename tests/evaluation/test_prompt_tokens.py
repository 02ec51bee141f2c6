"""`PromptTokens`: an echoed prompt's log-probabilities handed over as tensors, read as `TokenInfo`s
or as the columns a response is made of."""

import math

import torch

from ultratron.inference.sequence import PromptTokens, TokenInfo


def test_columns_and_token_infos_say_the_same():
    ids = [5, 9, 2, 7]
    logprobs = torch.tensor([math.nan, -1.5, -0.25, -3.0])  # the first position's value is never read
    top_ids = torch.tensor([[0, 0], [9, 4], [2, 1], [3, 7]], dtype=torch.int32)
    top_values = torch.tensor([[0.0, 0.0], [-1.5, -2.0], [-0.25, -1.75], [-0.5, -3.0]])
    tokens = PromptTokens(ids, logprobs, top_ids, top_values)
    expected = [TokenInfo(5, None, None), TokenInfo(9, -1.5, [(9, -1.5), (4, -2.0)]),
                TokenInfo(2, -0.25, [(2, -0.25), (1, -1.75)]), TokenInfo(7, -3.0, [(3, -0.5), (7, -3.0)])]
    assert len(tokens) == 4 and list(tokens) == expected and tokens[2] == expected[2] and tokens[-1] == expected[3]
    assert tokens.columns() == (ids, [None, -1.5, -0.25, -3.0],
                                [None, [(9, -1.5), (4, -2.0)], [(2, -0.25), (1, -1.75)], [(3, -0.5), (7, -3.0)]])
    generated = [TokenInfo(1, -0.5, None)]
    assert tokens + generated == expected + generated and [] + tokens == expected


def test_without_alternatives_every_top_is_none():
    tokens = PromptTokens([3, 4], torch.tensor([0.0, -2.0]))
    assert tokens.columns() == ([3, 4], [None, -2.0], [None, None])
    assert list(tokens) == [TokenInfo(3, None, None), TokenInfo(4, -2.0, None)]
