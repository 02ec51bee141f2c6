"""One layout and one model shape: the fields are listed here once, and the planner's `Layout`, the
trainer's config and every `ultratron plan` subcommand's generated flags must have exactly those,
with one definition each (type, help, choices, bounds). A field added to `Layout` shows up in the
config and in the flags by itself; a field restated anywhere else fails here."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from ultratron.cli import build_parser
from ultratron.config import Config, ModelConfig, ParallelConfig, TrainingConfig, load_config
from ultratron.config.loader import type_hints
from ultratron.config.precision import AUTO, AUTO_HELP
from ultratron.errors import ConfigError
from ultratron.fields import taken_from
from ultratron.models.presets import ModelShape
from ultratron.parallel.dims import ParallelDims
from ultratron.planning.layout import Layout

LAYOUT_FIELDS = ("dp", "dp_replicate", "zero", "tp", "sp", "pp", "pp_schedule", "pp_virtual_stages", "pp_split",
                 "pp_balance", "cp", "ep", "micro_batch_size", "grad_accum", "seq_len", "precision", "fp8_scaling",
                 "recompute", "compile", "loss_chunk",
                 "offload_activations", "fp32_grad_accum", "attention_fp32", "zero3_units")
DERIVED_BY_THE_CONFIG = {"grad_accum"}  # from training.batch_tokens
PLANNER_ONLY = {"fp32_grad_accum", "attention_fp32", "zero3_units"}  # (why: Layout's docstring)
SHAPE_FIELDS = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings", "rope_theta",
                "max_seq_len", "head_dim", "qk_norm", "sliding_window", "sliding_window_pattern",
                "n_experts", "n_active_experts", "n_shared_experts",
                "expert_ffn_dim", "n_dense_layers", "router_score", "family")
PLAN_COMMANDS = ("memory", "estimate", "search")


def _group(command: str, title: str) -> list[argparse.Action]:
    """The actions of one argument group of `ultratron plan COMMAND`."""
    plan = build_parser("plan")._subparsers._group_actions[0].choices["plan"]
    parser = plan._subparsers._group_actions[0].choices[command]
    (group,) = [g for g in parser._action_groups if g.title.startswith(title)]
    return group._group_actions


def _definition(cls: type, name: str) -> tuple:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return type_hints(cls)[name], f.metadata["help"], f.metadata["choices"], f.metadata["minimum"]


def test_the_layout_fields_are_the_planners_the_configs_and_the_plan_flags():
    assert tuple(f.name for f in dataclasses.fields(Layout)) == LAYOUT_FIELDS
    in_config = taken_from(ParallelConfig, Layout) + taken_from(TrainingConfig, Layout)
    assert sorted(in_config) == sorted(set(LAYOUT_FIELDS) - DERIVED_BY_THE_CONFIG - PLANNER_ONLY)
    # the parallel section restates none: all it has besides the layout's is how cp attends and how
    # long a collective waits, neither of which changes the layout's memory or step
    assert [f.name for f in dataclasses.fields(ParallelConfig) if f.name not in in_config] == \
        ["cp_attention", "collective_timeout"]
    for section in (ParallelConfig, TrainingConfig):
        for name in taken_from(section, Layout):  # one definition: the same type, help, choices and bounds
            if (section, name) == (TrainingConfig, "precision"):  # but the trainer's own value, auto
                kind, text, choices, minimum = _definition(Layout, name)
                assert _definition(section, name) == (kind, AUTO_HELP + text, (AUTO, *choices), minimum)
                continue
            assert _definition(section, name) == _definition(Layout, name), name
    for command in PLAN_COMMANDS:
        actions = _group(command, "layout")
        assert [a.dest for a in actions] == list(LAYOUT_FIELDS), command
        assert [a.option_strings[0] for a in actions] == ["--" + n.replace("_", "-") for n in LAYOUT_FIELDS]
        assert all(a.help.startswith(_definition(Layout, a.dest)[1]) for a in actions), command


def test_the_shape_fields_are_the_presets_the_configs_and_the_plan_flags():
    assert tuple(f.name for f in dataclasses.fields(ModelShape)) == SHAPE_FIELDS
    assert taken_from(ModelConfig, ModelShape) == list(SHAPE_FIELDS)
    for name in SHAPE_FIELDS:  # the config's are optional: a preset fills those left unset
        shape_type, *rest = _definition(ModelShape, name)
        assert _definition(ModelConfig, name) == (shape_type | None, *rest), name
    for command in PLAN_COMMANDS:
        actions = _group(command, "model shape")
        assert [a.dest for a in actions] == list(SHAPE_FIELDS), command
        assert all(a.help == _definition(ModelShape, a.dest)[1] for a in actions), command


def test_the_config_embeds_the_layout_and_the_mesh_takes_its_degrees(monkeypatch):
    cfg = load_config(None, ["--parallel.dp", "4", "--parallel.dp_replicate", "2", "--parallel.zero", "3",
                             "--parallel.tp", "2", "--training.seq_len", "128", "--training.micro_batch_size", "2",
                             "--training.batch_tokens", str(4 * 2 * 128 * 3)])
    layout = cfg.layout
    assert (layout.dp, layout.dp_replicate, layout.tp, layout.seq_len, layout.micro_batch_size) == (4, 2, 2, 128, 2)
    assert layout.grad_accum == cfg.grad_accum_steps == 3
    fresh = Config()
    fresh.layout = layout  # written back: every layout field, and the batch it makes
    assert fresh.layout == layout and fresh.training.batch_tokens == cfg.training.batch_tokens
    monkeypatch.setenv("WORLD_SIZE", "8")
    dims = ParallelDims.from_config(layout)
    assert (dims.dp, dims.dp_shard, dims.tp, dims.zero, dims.product) == (4, 2, 2, 3, 8)


@pytest.mark.parametrize("flags,message", [
    (["--parallel.zero", "4"], "parallel.zero: 4 is not one of 0, 1, 2, 3"),
    (["--parallel.tp", "0"], "parallel.tp must be ≥ 1, got 0"),
    (["--training.recompute", "some"], "training.recompute: 'some' is not one of none, selective, full"),
])
def test_the_config_checks_a_layout_field_as_its_definition_says(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, flags)
