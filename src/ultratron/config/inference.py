"""Settings of `ultratron eval` and `ultratron serve`: flat dataclasses whose fields become the
commands' flags (`config.loader.add_arguments`), so no flag is written twice."""

from __future__ import annotations

from dataclasses import dataclass

from ultratron.config.endpoint import EndpointConfig
from ultratron.fields import option


@dataclass
class EvalSettings(EndpointConfig):
    checkpoint: str | None = option(None, "a checkpoint, checkpoints or run directory (local backend); local or "
                                          "a URL such as s3://bucket/prefix")
    checkpoint_endpoint: str | None = option(None, "endpoint URL of the S3-compatible store an s3:// --checkpoint "
                                                   "is in (default: $AWS_ENDPOINT_URL, else AWS)")
    tasks: str = option("builtin", "comma-separated: builtin, task names, task files")
    max_examples: int = option(100, "examples per task (0: all)")
    json: str | None = option(None, "write results here as JSON")
    details: bool = option(False, "include per-example log-likelihoods and outputs")
    device: str = option("cpu", "device of the local backend")
    threads: int = option(0, "torch threads (0: torch's default)")
    step: int | None = option(None, "training step to record (default: the checkpoint's)")
    quiet: bool = option(False, "print no table")
    held_out_fraction: float | None = option(None, "the built-in suite comes from this held-out split of the built-in "
                                                   "corpus: the data.held_out_fraction of the run evaluated (default: "
                                                   "a checkpoint's own; 0.05 for an endpoint)", minimum=0)


@dataclass
class ServeSettings:
    checkpoint: str = option(help="a checkpoint, checkpoints or run directory; local or a URL such as s3://bucket/prefix")
    checkpoint_endpoint: str | None = option(None, "endpoint URL of the S3-compatible store an s3:// --checkpoint is "
                                                   "in (default: $AWS_ENDPOINT_URL, else AWS)")
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(0, "port to listen on; 0: a free port, printed at the start")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' (default: $ULTRATRON_API_KEY; none: open)")
    model_name: str = option("ultratron", "the model id clients pass")
    device: str = option("cpu", "device to run the model on")
    dtype: str | None = option(None, "weights, activations and KV cache in bf16 or fp32 (default: bf16 on a GPU, "
                                     "fp32 on a CPU); logits and log-probabilities are fp32 either way",
                               choices=("bf16", "fp32"))
    request_timeout: float = option(600.0, "seconds a non-streamed request may generate before it is stopped "
                                           "and answered 504 (0: no limit); a client that disconnects stops "
                                           "its generation at once", minimum=0)
    max_batch: int = option(32, "most sequences generated together")
    max_queue: int = option(256, "waiting sequences before new requests are answered 429 (back-pressure)")
    max_model_len: int | None = option(None, "longest prompt + completion served (default: the model's context); "
                                             "the default KV cache holds --max-batch sequences this long")
    kv_cache_tokens: int | None = option(None, "positions of the paged KV cache (blocks of 16 shared by the running "
                                               "sequences, taken as they grow); a request longer is refused "
                                               "(default: --max-batch × --max-model-len)", minimum=16)
    prefix_cache_tokens: int = option(32768, "prompt positions the prefix cache keeps (keys/values and the "
                                             "prompt log-probabilities echo requests report), reused by later "
                                             "prompts that start the same way; 0: off", minimum=0)
    max_batched_tokens: int = option(8192, "prompt tokens computed per scheduler iteration; longer prompts are "
                                           "prefilled in chunks between decode steps", minimum=1)
    batching: str = option("continuous", "continuous: requests join and leave the running batch at token "
                                         "boundaries; static: fixed groups, each run to its end",
                           choices=("continuous", "static"))
    max_body_bytes: int = option(1 << 20, "largest request body accepted")
    threads: int = option(0, "torch intra-op threads (0: torch's default)")
