"""Export to the Hugging Face Llama format: config.json, model.safetensors, tokenizer files.

Two conventions differ from ours and are converted here:
- RoPE: ultratron rotates interleaved (even, odd) channel pairs; HF Llama rotates the two halves
  of each head (`rotate_half`). Permuting the rows of wq and wk per head — evens first, then
  odds — makes the two identical (the same permutation Meta's conversion script applies).
- Names: `layers.N.attention.wq` → `model.layers.N.self_attn.q_proj`, SwiGLU w1/w3/w2 →
  gate/up/down_proj, and so on.
QK-norm and soft-capping have no place in HF's Llama, so such models are refused. A model with
q/k/v biases is written as Qwen2 (Llama with exactly those biases). `hf_import.py` is the inverse
(for the dense families).

A mixture of experts is written as Mixtral (no QK-norm) or Qwen3-MoE (QK-norm; dense first layers
as its `mlp_only_layers`) when its routing is theirs: softmax scores, top-k, no shared experts,
no routing bias learned (DeepSeek-V3's balancing moves it; neither class has it), Mixtral with the
chosen scores rescaled to 1. Each expert becomes the per-expert w1/w3/w2 (Mixtral) or
gate/up/down_proj (Qwen3-MoE) weights the published checkpoints hold. Anything else is refused,
every reason listed. QK-norm weights follow their heads' RoPE permutation. Capacity limits apply in
training only, so an exported model routes as ours evaluates.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ultratron.atomic import atomic_path
from ultratron.errors import ExportError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# Per-layer names: ours → Hugging Face Llama's (the same in Mistral and Qwen2).
LAYER_NAMES = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
               "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
               "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
               "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
               "ffn_norm": "post_attention_layernorm"}


def rope_to_half_split(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows (of a weight or a bias) from interleaved pairs (0,1),(2,3)… to
    halves (0,2,4…, 1,3,5…)."""
    out_dim, rest = weight.shape[0], weight.shape[1:]
    head_dim = out_dim // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(out_dim, *rest)


def rope_parameters(args) -> dict:
    """The model's RoPE settings as Hugging Face names them (rope_type, rope_theta, factor, ...)."""
    return {"rope_type": "default" if args.rope_scaling == "none" else args.rope_scaling,
            "rope_theta": args.rope_theta, **(args.rope_scaling_params or {})}


def check_exportable(args, state: dict | None = None) -> None:
    if args.n_experts:
        return _check_moe(args, state or {})
    problems = []
    if args.qk_norm:
        problems.append("model.qk_norm=true: Hugging Face's Llama has no QK-norm")
    if args.attn_softcap > 0:
        problems.append(f"model.attn_softcap={args.attn_softcap}: Hugging Face's Llama has no attention soft-cap")
    if args.final_softcap > 0:
        problems.append(f"model.final_softcap={args.final_softcap}: Hugging Face's Llama has no logit soft-cap")
    if problems:
        raise ExportError([f"cannot export to the Hugging Face Llama format: {p}" for p in problems])


def _check_moe(args, state: dict) -> None:
    problems = []
    if args.n_shared_experts:
        problems.append(f"model.n_shared_experts={args.n_shared_experts}: Mixtral and Qwen3-MoE have no shared experts")
    if args.router_score != "softmax":
        problems.append(f"model.router_score={args.router_score}: Mixtral and Qwen3-MoE route by softmax")
    if not args.qk_norm and not args.router_norm_topk:
        problems.append("model.router_norm_topk=false: Mixtral rescales the chosen experts' scores to 1")
    if not args.qk_norm and args.n_dense_layers:
        problems.append(f"model.n_dense_layers={args.n_dense_layers}: Mixtral has no dense layers (Qwen3-MoE, with "
                        "model.qk_norm, does)")
    if any(float(v.abs().max()) > 0 for k, v in state.items() if k.endswith("router.expert_bias")):
        problems.append("the routing bias has moved (model.moe_bias_update): Mixtral and Qwen3-MoE route without one")
    for name, what in (("qkv_bias", "q/k/v biases"), ("attn_softcap", "an attention soft-cap"),
                       ("final_softcap", "a logit soft-cap")):
        if getattr(args, name):
            problems.append(f"model.{name}={getattr(args, name)}: Mixtral and Qwen3-MoE have no {what}")
    if problems:
        raise ExportError([f"cannot export this mixture of experts to Hugging Face: {p}" for p in problems])


def _moe_config(args) -> dict:
    if not args.qk_norm:
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "intermediate_size": args.expert_ffn_dim or args.ffn_dim, "num_local_experts": args.n_experts,
                "num_experts_per_tok": args.n_active_experts, "router_aux_loss_coef": args.moe_aux_loss,
                "router_jitter_noise": 0.0, "output_router_logits": False, "sliding_window": None}
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "intermediate_size": args.ffn_dim, "moe_intermediate_size": args.expert_ffn_dim or args.ffn_dim,
            "num_experts": args.n_experts, "num_experts_per_tok": args.n_active_experts,
            "norm_topk_prob": args.router_norm_topk, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(args.n_dense_layers)), "router_aux_loss_coef": args.moe_aux_loss,
            "output_router_logits": False, "use_sliding_window": False, "sliding_window": None}


def hf_config(args, eos_id: int, dtype: str, bos_id: int | None = None) -> dict:
    family = ("Qwen2ForCausalLM", "qwen2") if args.qkv_bias else ("LlamaForCausalLM", "llama")
    scaling = rope_parameters(args) if args.rope_scaling != "none" else None
    config = {
        "architectures": [family[0]], "model_type": family[1],
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "rope_parameters": rope_parameters(args),
        "rope_scaling": scaling, "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": args.init_std,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": None, "use_cache": True,
        "torch_dtype": dtype, "dtype": dtype,
    }
    return config | (_moe_config(args) if args.n_experts else {})


def hf_state_dict(state: dict, args, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Our parameter names and RoPE layout → HF Llama's."""
    out = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"]}
    if not args.tie_embeddings:
        out["lm_head.weight"] = state["output.weight"]
    biased = ("attention.wq", "attention.wk", "attention.wv") if args.qkv_bias else ()
    for i in range(args.n_layers):
        moe = args.n_experts and i >= args.n_dense_layers
        if args.qk_norm:  # (MoE only) each head's channels follow the RoPE permutation of its rows
            for norm in ("q_norm", "k_norm"):
                out[f"model.layers.{i}.self_attn.{norm}.weight"] = rope_to_half_split(
                    state[f"layers.{i}.attention.{norm}.weight"], 1)
        if moe:
            out |= _expert_tensors(state, args, i)
        for ours, theirs in LAYER_NAMES.items():
            if moe and ours.startswith("feed_forward"):
                continue
            for kind in ("weight", "bias") if ours in biased else ("weight",):
                tensor = state[f"layers.{i}.{ours}.{kind}"]
                if ours == "attention.wq":
                    tensor = rope_to_half_split(tensor, args.n_heads)
                elif ours == "attention.wk":
                    tensor = rope_to_half_split(tensor, args.n_kv_heads)
                out[f"model.layers.{i}.{theirs}.{kind}"] = tensor
    return {k: v.detach().to(dtype).contiguous().clone() for k, v in out.items()}


def _expert_tensors(state: dict, args, i: int) -> dict[str, torch.Tensor]:
    """One MoE layer's router and experts under Mixtral's or Qwen3-MoE's names."""
    ours = f"layers.{i}.feed_forward"
    block, names = ((f"model.layers.{i}.block_sparse_moe", ("w1", "w3", "w2")) if not args.qk_norm else
                    (f"model.layers.{i}.mlp", ("gate_proj", "up_proj", "down_proj")))
    out = {f"{block}.gate.weight": state[f"{ours}.router.gate.weight"]}
    for e in range(args.n_experts):
        for mine, theirs in zip(("w1", "w3", "w2"), names, strict=True):
            out[f"{block}.experts.{e}.{theirs}.weight"] = state[f"{ours}.experts.{mine}"][e]
    return out


def export_hf(model, tokenizer, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write a Hugging Face Llama directory for `model` (an ultratron Llama) and its tokenizer."""
    from safetensors.torch import save_file

    args = model.args
    state = model.state_dict()
    check_exportable(args, state)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty; choose a new --out directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(state, args, DTYPES[dtype])
    with atomic_path(out) as tmp:  # the directory appears whole (replacing an empty `out`) or not at all
        tmp.mkdir()
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_json = lambda name, data: (tmp / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        bos = tokenizer.bos_token
        bos_id = None if bos is None else tokenizer.hf.token_to_id(bos)
        write_json("config.json", hf_config(args, tokenizer.eos_id, dtype, bos_id))
        write_json("generation_config.json", {"eos_token_id": tokenizer.eos_id, "bos_token_id": bos_id})
        (tmp / "tokenizer.json").write_text(tokenizer.to_json(), encoding="utf-8")
        write_json("tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tokenizer.eos_token, "bos_token": bos,
            "pad_token": None, "unk_token": None, "model_max_length": args.max_seq_len,
            "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False,
            **({"chat_template": tokenizer.chat_template} if tokenizer.chat_template else {})})
        write_json("special_tokens_map.json", {"eos_token": tokenizer.eos_token,
                                               **({"bos_token": bos} if bos else {})})
    return out
