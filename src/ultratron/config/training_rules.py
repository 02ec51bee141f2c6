"""Rules of three training fields: `training.batch_ramp` (the ramp itself: `training/batch_ramp.py`),
`training.profile_steps` (`training/profiling.py`) and `training.precision fp8` (`parallel/float8.py`).
The layout's rules, `training.compile`'s with tensor parallel among them, are the planner's
(`planning.layout.check_layout`). Torch-free."""

from __future__ import annotations

import importlib.util

from ultratron.planning.rules import pipeline_problems


def ramp_problems(cfg, micro: int, reported: list[str]) -> list[str]:
    """training.batch_ramp: a start of whole micro-batches (under pp: a multiple of pp of them, so
    every step of the ramp keeps the pipeline full), below the full batch. `reported`: the
    problems found so far (the pipeline's own are not repeated)."""
    t, par, ramp = cfg.training, cfg.parallel, cfg.training.batch_ramp
    if not ramp:
        return []
    if sorted(ramp) != ["start", "tokens"]:
        return [f"training.batch_ramp takes start and tokens (e.g. start=32768,tokens=4e9), got {', '.join(ramp)}"]
    start, over = ramp["start"], ramp["tokens"]
    if over <= 0 or not over.is_integer():
        return [f"training.batch_ramp.tokens must be a positive whole number, got {over:g}"]
    unit = micro * max(1, par.pp)
    what = (f"micro_batch_size × seq_len × dp × pp = {t.micro_batch_size} × {t.seq_len} × {par.dp} × {par.pp}"
            if par.pp > 1 else f"micro_batch_size × seq_len × dp = {t.micro_batch_size} × {t.seq_len} × {par.dp}")
    if not start.is_integer() or start < unit or start % unit:
        lower = max(unit, int(start) // unit * unit)
        return [f"training.batch_ramp.start={start:g} must be a positive multiple of {what} = {unit} (whole "
                f"micro-batches{', pp of them at a time' if par.pp > 1 else ''}); try {lower} or {lower + unit}"]
    if start >= t.batch_tokens:
        return [f"training.batch_ramp.start={start:g} must be below training.batch_tokens={t.batch_tokens}"]
    if par.pp == 1:
        return []
    first = pipeline_problems(cfg.model, pp=par.pp, schedule=par.pp_schedule, virtual_stages=par.pp_virtual_stages,
                              split=par.pp_split, micro_batches=int(start) // micro,
                              micro_batches_from="the first step of training.batch_ramp")
    return [line for line in first if line not in reported]  # (the layout's own problems are reported once)


def parse_steps(text: str) -> tuple[int, int] | None:
    """training.profile_steps: "N..M" → (N, M); "" → None. Raises ValueError with the reason."""
    if not text:
        return None
    first, sep, last = text.partition("..")
    if not sep or not first.strip().isdigit() or not last.strip().isdigit():
        raise ValueError(f"training.profile_steps: expected N..M (e.g. 5..7), got {text!r}")
    n, m = int(first), int(last)
    if not 1 <= n <= m:
        raise ValueError(f"training.profile_steps: needs 1 ≤ N ≤ M, got {text!r}")
    return n, m


def profile_problems(text: str) -> list[str]:
    try:
        parse_steps(text)
    except ValueError as err:
        return [str(err)]
    return []


def fp8_problems(cfg) -> list[str]:
    """training.precision fp8 needs torchao and torch's own linear layers (LoRA and oneDNN replace them)."""
    t = cfg.training
    if t.precision != "fp8":
        return []
    p = []
    if importlib.util.find_spec("torchao") is None:
        p.append("training.precision=fp8 needs the torchao package, which is not installed: "
                 "pip install 'ultratron[fp8]'")
    if cfg.lora.rank > 0:
        p.append(f"training.precision=fp8 does not yet work with LoRA (lora.rank={cfg.lora.rank}); use bf16")
    if t.cpu_linear != "aten":
        p.append("training.precision=fp8 converts torch's own linear layers; use training.cpu_linear=aten")
    return p


def document_problems(cfg) -> list[str]:
    """What document masking and loss-masked targets (chat) do not yet compose with."""
    par, data, p = cfg.parallel, cfg.data, []
    settings = f"data.document_masking={data.document_masking}, data.format={data.format}"
    if par.cp > 1 and par.pp > 1 and data.masked_targets:
        p.append(f"document masking or chat data ({settings}) does not yet work with both parallel.cp={par.cp} and "
                 f"parallel.pp={par.pp} (the pipeline loss does not weight cp shards by counted targets); use one")
    return p
