"""What a query may attend, as a small spec rather than an S×S tensor.

A `MaskSpec` says which keys each query sees: keys at positions not after its own (causal), within
its document when rows are packed (`documents`: a document number per token of the row; with
`shared`, also every key before the query's `shared` index: prompts that share a prefix packed as
a tree, each after the first seeing the first's keys up to where it forks), and no
more than `window` positions back (a sliding window: query i sees keys i−window+1 .. i, as Mistral's
and transformers' sliding-window masks do). `softcap` caps the scores (cap · tanh(s / cap), Gemma 2)
and `backend` says which kernel runs it (`models/attention.py`). The model builds one spec per forward
from O(S) tensors; each layer adds its window and soft cap (`for_layer`). The attention backends turn
it into what their kernel takes: a FlexAttention `BlockMask` built block by block (`models/flex.py`),
or a dense mask for one chunk of queries at a time, never the whole S × S.

Positions are indices into the packed row: `rows` are the queries' (None: 0 .. q−1, the whole row),
keys sit at 0 .. k−1 (a KV cache: every cached position; context parallel: the block's positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

BACKENDS = ("auto", "flex", "sdpa")  # model.attention's choices (models/presets.py ATTENTION_BACKENDS)


@dataclass(frozen=True, eq=False)
class MaskSpec:
    documents: torch.Tensor | None = None  # (batch, row length): a document number per token
    # (batch, row length), with documents: a query sees every key before its index here, whatever the
    # key's document (a KV cache's tree of prompts that share a prefix; inference only, no window)
    shared: torch.Tensor | None = None
    rows: torch.Tensor | None = None  # the queries' positions in the row, (q,) or (batch, q); None: 0 .. q-1
    window: int = 0  # 0: no sliding window
    softcap: float = 0.0  # 0: no soft cap
    backend: str = "auto"
    cache: dict = field(default_factory=dict, repr=False)  # what a backend built from it (shared by for_layer)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"attention backend {self.backend!r}: one of {', '.join(BACKENDS)}")
        if self.window < 0:
            raise ValueError(f"sliding window {self.window}: 0 (none) or a positive number of positions")

    def for_layer(self, window: int, softcap: float) -> MaskSpec:
        return self if (window, softcap) == (self.window, self.softcap) else replace(self, window=window,
                                                                                   softcap=softcap)

    @property
    def plain(self) -> bool:
        """Causal over the whole row and nothing else: what SDPA's `is_causal` does."""
        return self.documents is None and self.rows is None and not self.window and not self.softcap

    @property
    def masked(self) -> bool:
        """Anything beyond causal on keys (documents or a window); a soft cap alone is a score change."""
        return self.documents is not None or self.rows is not None or self.window > 0


def query_positions(spec: MaskSpec, n: int, device) -> torch.Tensor:
    """The queries' positions in the row, (1 or batch, n)."""
    rows = torch.arange(n, device=device) if spec.rows is None else spec.rows.to(device)
    return rows if rows.dim() == 2 else rows[None]


def allowed(spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """(1 or batch, 1, n, m) booleans: may the query at q_pos (1 or batch, n) attend the key at k_pos (m,)."""
    q, k = q_pos[:, :, None], k_pos[None, None, :]
    ok = k <= q
    if spec.window:
        ok = ok & (q - k < spec.window)
    if spec.documents is not None:
        docs = spec.documents
        q_docs = docs.gather(1, q_pos.expand(docs.shape[0], -1))
        same = q_docs[:, :, None] == docs[:, k_pos][:, None, :]
        if spec.shared is not None:
            same = same | (k < spec.shared.gather(1, q_pos.expand(docs.shape[0], -1))[:, :, None])
        ok = ok & same
    return ok[:, None]


def document_starts(documents: torch.Tensor) -> torch.Tensor:
    """(batch, seq): the position where each token's document starts."""
    index = torch.arange(documents.shape[1], device=documents.device)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return torch.cummax(torch.where(starts, index, 0), dim=1).values


def key_span(spec: MaskSpec, q_pos: torch.Tensor) -> tuple[int, int]:
    """[lo, hi): the keys that queries at q_pos can see at most (a host read of two numbers)."""
    hi, lo = int(q_pos.max()) + 1, 0
    if spec.documents is not None and spec.shared is None:  # (shared keys start at 0)
        starts = document_starts(spec.documents)
        lo = int(starts.gather(1, q_pos.expand(starts.shape[0], -1)).min())
    if spec.window:
        lo = max(lo, int(q_pos.min()) - spec.window + 1)
    return lo, hi
