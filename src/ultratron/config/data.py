"""The `[data]` section of the trainer's config: where the training text or shards come from, a
mixture of sources, and how shards on an object store are cached (docs/data.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ultratron.fields import option


@dataclass
class DataConfig:
    path: str | None = option(None, "none: the built-in corpus (this interpreter's standard library; with "
                                    "data.format=chat the built-in conversation set); else a directory of text "
                                    "files, a text file, JSONL with a text field (chat: a messages field), or a "
                                    "prepared directory (tokenizer.json + train/ [+ val/], as `ultratron data run` "
                                    "writes)")
    tokenizer: str | None = option(None, "a tokenizer.json to load instead of training one")
    held_out_fraction: float = option(0.05, "share of files kept for validation, chosen by file hash")
    max_bytes: int = option(0, "stop reading the corpus after this many bytes; 0 reads everything")
    cache_dir: str | None = option(None, "where tokenizer and shards go; default RUN_DIR/data")
    extensions: str = option(".py,.txt,.md,.rst,.jsonl,.json", "files read from a directory")
    sources: list[str] = option(factory=list, help="a mixture: NAME=PREPARED_DIR entries (each a tokenizer.json + "
                                                   "train/ [+ val/], one shared tokenizer); replaces data.path")
    weights: dict[str, float] = option(factory=dict, help="the mixture's weights, NAME=WEIGHT (normalised; "
                                                          "default: equal)")
    schedule: list[str] = option(factory=list, help="weights over training tokens: points 'TOKENS NAME=W NAME=W "
                                                    "...', linear in between, held after the last")
    exhausted: str = option("repeat", "a mixture source that runs out: repeat it (counted in metrics) or stop the run",
                            choices=("repeat", "stop"))
    format: str = option("text", "text: plain documents, every token counts in the loss; chat: JSONL of "
                                 "{\"messages\": [{\"role\", \"content\"}, ...]} rendered with the model's chat "
                                 "template, packed whole into sequences, the loss on the assistant turns only",
                         choices=("text", "chat"))
    cache_limit: int = option(16, "shards on an object store (data.path or a source s3://...): how many whole shards "
                                  "the local cache holds (bytes on disk: this x the shard size, plus the one being "
                                  "fetched); the least recently used is evicted (docs/data.md)", minimum=1)
    window: int = option(0, "shards on an object store: the order is shuffled within windows of this many shards "
                            "(the next window prefetched); 0: half of data.cache_limit", minimum=0)
    endpoint: str = option("", "endpoint URL of an S3-compatible store (MinIO, Ceph, ...) for s3:// data; "
                               "credentials come from the usual AWS_* environment variables")
    document_masking: str = option("auto", "attention stays within each packed document and positions restart at "
                                           "each (auto: on for chat, off for text)", choices=("auto", "on", "off"))

    @property
    def documents(self) -> bool:
        """Whether packed documents are masked from each other (data.document_masking resolved)."""
        return self.document_masking == "on" or (self.document_masking == "auto" and self.format == "chat")

    @property
    def masked_targets(self) -> bool:
        """Whether some targets may not count in the loss (chat's non-assistant turns, document ends)."""
        return self.format == "chat" or self.documents

    @property
    def builtin_corpus(self) -> bool:
        """Whether the run trains on the built-in corpus (whose evaluation suite follows its split)."""
        return self.path is None and not self.sources
