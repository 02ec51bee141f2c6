"""The curation stages: one module per stage, each with `run(ctx: StageContext) -> dict`.

`RUNNERS` maps a stage name (as `pipeline.stages` and `ultratron data STAGE` spell it) to that
function. The modules are imported normally, so the dependency is plain to read and to check
(runner → stages → frame → config); a stage that needs a heavy library (torch, pyarrow, rensa)
imports it inside the function that uses it.
"""

from __future__ import annotations

from collections.abc import Callable

from ultratron.curation.frame import StageContext
from ultratron.curation.stages import (
    decontaminate,
    exact_dedup,
    filters,
    language,
    near_dedup,
    normalize,
    perplexity,
    pii,
    read,
    shard,
    substring_dedup,
    tokenize,
    write_chat,
)

RUNNERS: dict[str, Callable[[StageContext], dict]] = {
    "read": read.run,
    "normalize": normalize.run,
    "language": language.run,
    "exact-dedup": exact_dedup.run,
    "near-dedup": near_dedup.run,
    "substring-dedup": substring_dedup.run,
    "filter": filters.run,
    "decontaminate": decontaminate.run,
    "pii": pii.run,
    "perplexity": perplexity.run,
    "tokenize": tokenize.run,
    "shard": shard.run,
    "write-chat": write_chat.run,
}
