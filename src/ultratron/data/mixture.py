"""Training sequences drawn from several datasets in chosen proportions: deterministic, rank-aware,
resumable exactly — the same interface as `TokenLoader` (`next_batch`, `state_dict`, `load_state_dict`).

Which source the g-th sequence of the one-rank stream comes from is decided by smooth weighted
round-robin (the deficit rule of nginx's upstream balancer): every source earns its current weight
in credit per sequence and the richest source gives the sequence and pays 1. Each source's share
then stays within one sequence of its weight at every point of the run (a random draw would wander
by the square root of the count), and a schedule that moves the weights is followed as closely.
Within a source, sequences come in that source's own seeded order (a `TokenLoader` of one
sequence at a time), reshuffled each time it is used up and repeated, or, with
`exhausted="stop"`, the run stops there with an error naming it.

Ranks: every micro-batch step takes `dp_world × micro_batch_size` sequences of the one-rank stream
and rank r reads the r-th block, like `TokenLoader`. Every rank walks the whole stream's choices
(a few comparisons per sequence), so each knows the global tokens per source without
communication; it reads only its own sequences. The state (credits, sequences taken per source,
each source's own position) is global, so a run resumes on any layout, or with another global
batch, and reads each sequence once, per source too.
"""

from __future__ import annotations

from ultratron.data.loader import TokenLoader, batch_of
from ultratron.data.mixture_spec import MixtureSpec
from ultratron.data.prepare import PreparedData, open_shards
from ultratron.errors import DataError


class MixtureLoader:
    def __init__(self, spec: MixtureSpec, shards: list, *, seq_len: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_world: int = 1, seed: int = 0, exhausted: str = "repeat",
                 use_schedule: bool = True, documents: bool = False):
        if exhausted not in ("repeat", "stop"):
            raise ValueError(f"exhausted={exhausted!r} is not repeat or stop")
        self.spec, self.seq_len, self.micro_batch_size = spec, seq_len, micro_batch_size
        self.seed, self.exhausted, self.documents = seed, exhausted, documents
        self.view(dp_rank, dp_world)
        self.use_schedule = use_schedule
        self.sources = []
        for i, (name, shard_set) in enumerate(zip(spec.names, shards, strict=True)):
            try:  # each source has its own order: seeded by (seed, its index)
                self.sources.append(TokenLoader(shard_set, seq_len=seq_len, micro_batch_size=1,
                                                seed=seed * 1_000_003 + i))
            except DataError:
                raise DataError(f"data source {name!r} ({shard_set.root}) holds no sequence of {seq_len + 1} "
                                "tokens; add data or lower training.seq_len") from None
        self.n_sequences = sum(s.n_sequences for s in self.sources)
        self.credit = [0.0] * len(self.sources)
        self.sequences_seen = [0] * len(self.sources)  # global (every rank), this run so far
        self.taken = 0  # sequences of the one-rank stream so far

    def view(self, dp_rank: int, dp_world: int) -> None:
        """Read as rank `dp_rank` of `dp_world` from the next micro-batch step on."""
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, {dp_world})")
        self.dp_rank, self.dp_world = dp_rank, dp_world

    @property
    def consumed(self) -> int:
        """Sequences of the global stream consumed so far, by every rank."""
        return self.taken

    def _weights(self) -> tuple[float, ...]:
        if not self.use_schedule:
            return self.spec.weights
        return self.spec.weights_at(self.taken * self.seq_len)

    def _choose(self) -> int:
        for i, w in enumerate(self._weights()):
            self.credit[i] += w
        best = max(range(len(self.credit)), key=lambda i: (self.credit[i], -i))
        self.credit[best] -= 1.0
        return best

    def _take(self, i: int) -> int:
        source = self.sources[i]
        if source.consumed + 1 > source.n_sequences and self.exhausted == "stop":
            raise DataError(f"data source {self.spec.names[i]!r} is used up: all {source.n_sequences} of its "
                            f"sequences were trained on (data.exhausted=stop); add data, lower its weight, or "
                            "set data.exhausted=repeat")
        self.sequences_seen[i] += 1
        self.taken += 1
        return int(source.next_indices()[0])

    def next_indices(self) -> list[tuple[int, int]]:
        """(source, sequence index) of this rank's next micro-batch; advances the global stream by
        the whole micro-batch step (every rank's block)."""
        mine = []
        for rank in range(self.dp_world):
            for _ in range(self.micro_batch_size):
                i = self._choose()
                index = self._take(i)
                if rank == self.dp_rank:
                    mine.append((i, index))
        return mine

    def next_batch(self) -> tuple:
        """(inputs, targets), each int64 of shape (micro_batch_size, seq_len): this rank's block
        (and with `documents` the document numbers, `loader.batch_of`)."""
        windows = [self.sources[i]._sequence(index) for i, index in self.next_indices()]
        return batch_of(windows, self.sources[0].shards.meta["eos_id"], self.documents)

    def metrics(self) -> dict[str, float]:
        """Tokens trained on per source (all ranks) and how often each was used up and repeated; the
        shard caches' counters (data/remote.py) summed over the sources on an object store."""
        out = {f"tokens/{n}": seen * self.seq_len for n, seen in zip(self.spec.names, self.sequences_seen,
                                                                      strict=True)}
        out |= {f"repeats/{n}": s.epoch for n, s in zip(self.spec.names, self.sources, strict=True)}
        for source in self.sources:  # the shard caches of sources on an object store, added up
            for key, value in source.metrics().items():
                out[key] = out.get(key, 0) + value
        return out

    def state_dict(self) -> dict:
        return {"names": list(self.spec.names), "credit": list(self.credit), "taken": self.taken,
                "sequences_seen": list(self.sequences_seen), "seq_len": self.seq_len, "seed": self.seed,
                "sources": [s.state_dict() for s in self.sources]}

    def load_state_dict(self, state: dict) -> None:
        if "names" not in state:
            raise DataError("data loader state is a single dataset's, but data.sources is a mixture now")
        if list(state["names"]) != list(self.spec.names):
            raise DataError(f"data loader state is of the mixture {state['names']}, not {list(self.spec.names)} "
                            "(were data.sources changed?)")
        for key in ("seq_len", "seed"):
            if state[key] != getattr(self, key):
                raise DataError(f"data loader state does not match: saved {key}={state[key]}, now "
                                f"{getattr(self, key)}")
        for name, source, saved in zip(self.spec.names, self.sources, state["sources"], strict=True):
            try:
                source.load_state_dict(saved)
            except DataError as err:
                raise DataError(f"data source {name!r}: {err}") from None
        self.credit = [float(c) for c in state["credit"]]
        self.sequences_seen = [int(n) for n in state["sequences_seen"]]
        self.taken = int(state["taken"])


def open_loader(data: PreparedData, split: str, *, seq_len: int, micro_batch_size: int, dp_rank: int = 0,
                dp_world: int = 1, seed: int = 0, exhausted: str = "repeat", documents: bool = False):
    """The loader of a split ("train" or "val"): a `TokenLoader` of one dataset or a `MixtureLoader`;
    None when there is no such split.

    A mixture's validation stream mixes the sources' held-out splits by the base weights (never
    the schedule, so that the number stays comparable over the run), repeating a small split
    rather than stopping; sources without a held-out split are left out and the rest renormalised."""
    if data.mixture is None:
        root = data.train_dir if split == "train" else data.val_dir
        if root is None:
            return None
        return TokenLoader(open_shards(data, root), seq_len=seq_len, micro_batch_size=micro_batch_size,
                           dp_rank=dp_rank, dp_world=dp_world, seed=seed, documents=documents)
    spec = data.mixture
    if split == "train":
        return MixtureLoader(spec, [open_shards(data, train) for train, _ in data.sources], seq_len=seq_len,
                             micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_world=dp_world, seed=seed,
                             exhausted=exhausted, documents=documents)
    keep = [i for i, (_, val) in enumerate(data.sources) if val is not None and spec.weights[i] > 0]
    if not keep:
        return None
    total = sum(spec.weights[i] for i in keep)
    val_spec = MixtureSpec(tuple(spec.names[i] for i in keep), tuple(spec.paths[i] for i in keep),
                           tuple(spec.weights[i] / total for i in keep))
    return MixtureLoader(val_spec, [open_shards(data, data.sources[i][1]) for i in keep], seq_len=seq_len,
                         micro_batch_size=micro_batch_size, seed=seed, use_schedule=False, documents=documents)


def source_loaders(data: PreparedData, split: str, *, seq_len: int, micro_batch_size: int, seed: int = 0,
                   documents: bool = False) -> dict:
    """Each source's own loader of a split, by name, for a mixture (for validation per source);
    the held-out split of each of several chat files; empty for one dataset. Sources without that
    split, or too small for one micro-batch, are left out."""
    if data.mixture is None:
        pairs = [(name, (None, val)) for name, val in (data.val_sources or {}).items()]
    else:
        pairs = list(zip(data.mixture.names, data.sources, strict=True))
    out = {}
    for name, (train, val) in pairs:
        root = train if split == "train" else val
        if root is None:
            continue
        try:
            out[name] = TokenLoader(open_shards(data, root), seq_len=seq_len, micro_batch_size=micro_batch_size,
                                    seed=seed, documents=documents)
        except DataError:
            continue
    return out
