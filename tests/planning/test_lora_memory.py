"""The planner's LoRA: its adapter count is the trainer's (one formula, checked against the adapted
model), the published figure for Llama-3-8B, and plan memory gives the frozen weights their
parameter bytes only and the adapters every term, split over tp as the trainer splits them
(tests/test_lora.py checks a tp rank's adapters against the same formula)."""

import pytest

from ultratron.models.presets import PRESETS
from ultratron.planning.layout import Layout
from ultratron.planning.lora import adapter_params
from ultratron.planning.memory import estimate_memory


@pytest.mark.parametrize("targets", [("q", "k", "v", "o", "gate", "up", "down"), ("v", "o"), ("q", "down")])
def test_the_formula_counts_the_adapted_models_parameters(targets):
    from ultratron.models.llama import Llama, LlamaArgs
    from ultratron.models.llama.parallel_plan import PLAN
    from ultratron.models.lora import apply_lora, count_trainable

    args = LlamaArgs(n_layers=3, dim=64, n_heads=8, n_kv_heads=2, ffn_dim=96, vocab_size=50, max_seq_len=16,
                     head_dim=12)
    model = Llama(args)
    apply_lora(model, 4, 8.0, list(targets), PLAN.lora_targets)
    assert count_trainable(model)[0] == adapter_params(args, 4, targets)


def test_llama3_8b_rank16_on_every_linear_layer_is_peft_s_published_count():
    # peft's print_trainable_parameters for Llama-3-8B, r=16 on q,k,v,o,gate,up,down: 41,943,040
    assert adapter_params(PRESETS["llama3-8b"], 16, ("q", "k", "v", "o", "gate", "up", "down")) == 41_943_040


def test_plan_memory_freezes_the_model_and_trains_the_adapters():
    shape = PRESETS["llama3-8b"]
    layout = Layout(dp=8, zero=3, seq_len=4096, precision="bf16")
    full = estimate_memory(shape, layout)
    lora = estimate_memory(shape, layout, lora=(16, ("q", "k", "v", "o", "gate", "up", "down")))
    adapters = adapter_params(shape, 16, ("q", "k", "v", "o", "gate", "up", "down"))
    assert lora.extra["lora_params_on_gpu"] == adapters
    # FSDP2 (ZeRO-3 over 8): fp32 weights 4/8, gradients 4/8, moments 8/8 per parameter
    assert lora.gradients == pytest.approx(adapters * 4 / 8)
    assert lora.optimizer_states == pytest.approx(adapters * 8 / 8)
    assert lora.parameters == pytest.approx(full.parameters + adapters * 4 / 8)
    assert lora.activations == full.activations
    # the peak is backward's, before FSDP2 makes its sharded gradients: LoRA saves the moments there
    assert full.peak_moment == lora.peak_moment == "backward"
    assert full.peak_bytes - lora.peak_bytes > 0.9 * full.optimizer_states
    # and the gradients (and the step's foreach temporaries, the adapters' only) at the optimizer step
    assert full.step_bytes - lora.step_bytes > 0.9 * (full.gradients + 1.5 * full.optimizer_states)


def test_plan_memory_splits_the_adapters_over_tp_as_the_trainer_does():
    shape = PRESETS["llama3-8b"]
    targets = ("q", "k", "v", "o", "gate", "up", "down")
    lora = estimate_memory(shape, Layout(dp=4, tp=2, zero=3, seq_len=4096, precision="bf16"), lora=(16, targets))
    # per block at r = 16, tp 2 (dim 4096, q 4096, k/v 1024, FFN 14336): q, k, v, gate, up keep A
    # whole and halve B, o and down halve A and keep B: 16 · (4096 + 2048 + 2 · (4096 + 512) +
    # 2048 + 4096 + 3 · (4096 + 7168)) = 884,736; 32 blocks
    assert lora.extra["lora_params_on_gpu"] == 32 * 884_736
    assert lora.optimizer_states == pytest.approx(32 * 884_736 * 8 / 4)  # fp32 moments, ZeRO-3 over dp 4
