"""`plan search` never proposes a layout the trainer refuses: every layout it ranks, written as the
config `plan search --out` writes, passes the trainer's own validation (`config.load_config`) and
its launch check (`ParallelDims.from_config` with the layout's world size); the config embeds the
very layout the search chose (`Config.layout`)."""

from __future__ import annotations

import pytest

from ultratron.config import load_config
from ultratron.config.layouts import config_toml
from ultratron.models.presets import PRESETS
from ultratron.parallel.dims import ParallelDims
from ultratron.planning.hardware import get_accelerator
from ultratron.planning.search import SearchSpec, search

SPECS = [  # (model, GPUs, global batch tokens, sequence length)
    ("llama3-8b", 8, 2**20, 8192),
    ("llama3-70b", 32, 4 * 2**20, 8192),  # cp=2 was once its best layout, which the trainer refuses
    ("llama3-405b", 512, 2**23, 8192),  # on 128 or 256 none fits once FSDP2 accumulates unsharded fp32 gradients
    ("tiny", 4, 8192, 256),
]


@pytest.mark.parametrize("model,gpus,batch,seq", SPECS, ids=[f"{m}-{g}gpus" for m, g, *_ in SPECS])
def test_every_ranked_layout_passes_the_trainers_validation(model, gpus, batch, seq, tmp_path, monkeypatch):
    spec = SearchSpec(PRESETS[model], get_accelerator("h100-sxm"), gpus, min(8, gpus), batch, seq)
    result = search(spec, top=0)
    assert result.ranked, result.summary
    monkeypatch.setenv("WORLD_SIZE", str(gpus))
    path = tmp_path / "layout.toml"
    for est in result.ranked:
        lay = est.layout
        path.write_text(config_toml(spec, est, model))
        cfg = load_config(path)  # raises ConfigError, naming the problem, for a layout the trainer refuses
        assert cfg.layout == lay, lay.describe()  # the config embeds the very layout the search chose
        dims = ParallelDims.from_config(cfg.layout)
        assert dims.product == gpus, lay.describe()
