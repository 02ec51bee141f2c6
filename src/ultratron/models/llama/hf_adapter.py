"""The Llama family ↔ Hugging Face transformers: config.json fields and tensor names, both ways.

Our decoder is, in transformers' terms, Llama (and Mistral, its sliding window imported), Qwen2 (q/k/v
biases), Qwen3 (QK-norm, a head width of its own), Mixtral (mixture of experts) or Qwen3-MoE
(mixture of experts with QK-norm and dense first layers). Two conventions differ from ours:
- RoPE: we rotate interleaved (even, odd) channel pairs; transformers rotates the two halves of each
  head (`rotate_half`). Permuting the rows of wq and wk per head — evens first, then odds — makes the
  two identical (the permutation Meta's conversion script applies); QK-norm weights follow it.
- Names: `layers.N.attention.wq` ↔ `model.layers.N.self_attn.q_proj`, SwiGLU w1/w3/w2 ↔
  gate/up/down_proj, a mixture of experts' 3-D w1/w3/w2 ↔ one tensor per expert (Mixtral's
  `block_sparse_moe.experts.E.w1/w3/w2`, Qwen3-MoE's `mlp.experts.E.gate/up/down_proj`: transformers
  5 fuses them in memory, but its checkpoints, and save_pretrained's, hold them per expert).
Routing: Mixtral takes the softmax's top k and rescales their scores to 1; Qwen3-MoE rescales when
`norm_topk_prob`; both as `models/moe.py` routes with router_score=softmax. Qwen3-MoE's dense layers
(`mlp_only_layers`, `decoder_sparse_step`) must be the first ones, as ours are. Capacity limits and
Mixtral's router jitter apply in training only, so the two evaluate alike.

DeepSeek-V3 (`DeepseekV3ForCausalLM`) is refused: its attention is multi-head latent attention (MLA),
which our decoder does not implement. What else does not map is refused with every reason.
"""

from __future__ import annotations

import torch

from ultratron.models.family import HFAdapter, HFTensors
from ultratron.models.llama.model import LlamaArgs

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
REFUSED = {"deepseek_v3": "DeepseekV3ForCausalLM uses multi-head latent attention (MLA), which ultratron's decoder "
                          "does not implement (its deepseek-v3-like preset has grouped-query attention in its place), "
                          "so its weights have nowhere to go"}
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}
ROPE_NUMBERS = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}

# Per-layer names: ours → transformers' (the same in every architecture above).
ATTENTION_NAMES = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                   "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                   "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
DENSE_FFN_NAMES = {"feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
                   "feed_forward.w2": "mlp.down_proj"}
# A mixture-of-experts layer: (its module, the names of each expert's w1, w3, w2).
EXPERT_NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
                "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}


def rope_to_half_split(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows (of a weight or a bias) from interleaved pairs (0,1),(2,3)… to
    halves (0,2,4…, 1,3,5…)."""
    out_dim, rest = weight.shape[0], weight.shape[1:]
    head_dim = out_dim // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(out_dim, *rest)


def half_split_to_rope(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `rope_to_half_split`: each head's halves (0,2,4…, 1,3,5…) back to pairs."""
    out_dim, rest = weight.shape[0], weight.shape[1:]
    head_dim = out_dim // n_heads
    return weight.reshape(n_heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(out_dim, *rest)


def model_type(args: LlamaArgs) -> str:
    """The transformers architecture a model of ours is written as."""
    if args.n_experts:
        return "qwen3_moe" if args.qk_norm else "mixtral"
    if args.qk_norm:
        return "qwen3"
    if args.qkv_bias:
        return "qwen2"
    return "mistral" if args.sliding_window else "llama"  # Mistral: Llama with a window on every layer


# ---- weights ----------------------------------------------------------------------------------------

def _same(hf: str) -> HFTensors:
    return HFTensors((hf,), lambda t: [t], lambda ts: ts[0])


def _rope_rows(hf: str, heads: int) -> HFTensors:
    return HFTensors((hf,), lambda t: [rope_to_half_split(t, heads)], lambda ts: half_split_to_rope(ts[0], heads))


def _experts(hf: list[str]) -> HFTensors:
    return HFTensors(tuple(hf), lambda t: list(t.unbind(0)), torch.stack)


def weight_map(args: LlamaArgs) -> dict[str, HFTensors]:
    """Our tensor name → the transformers tensors it is made of, for the architecture `model_type(args)`."""
    kind = model_type(args)
    out = {"tok_embeddings.weight": _same("model.embed_tokens.weight"), "norm.weight": _same("model.norm.weight"),
           "output.weight": _same("model.embed_tokens.weight" if args.tie_embeddings else "lm_head.weight")}
    biased = ("attention.wq", "attention.wk", "attention.wv") if args.qkv_bias else ()
    heads = {"attention.wq": args.n_heads, "attention.wk": args.n_kv_heads}
    for i in range(args.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for mine, hf in ATTENTION_NAMES.items():
            for part in ("weight", "bias") if mine in biased else ("weight",):
                name = f"{mine}.{part}"
                out[ours + name] = (_rope_rows(f"{theirs}{hf}.{part}", heads[mine]) if mine in heads
                                    else _same(f"{theirs}{hf}.{part}"))
        if args.qk_norm:  # each head's channels follow the RoPE permutation of its rows
            for norm in ("q_norm", "k_norm"):
                out[f"{ours}attention.{norm}.weight"] = _rope_rows(f"{theirs}self_attn.{norm}.weight", 1)
        if not args.is_moe_layer(i):
            out |= {f"{ours}{mine}.weight": _same(f"{theirs}{hf}.weight") for mine, hf in DENSE_FFN_NAMES.items()}
            continue
        block, names = EXPERT_NAMES[kind]
        out[f"{ours}feed_forward.router.gate.weight"] = _same(f"{theirs}{block}.gate.weight")
        for mine, hf in zip(("w1", "w3", "w2"), names, strict=True):
            out[f"{ours}feed_forward.experts.{mine}"] = _experts(
                [f"{theirs}{block}.experts.{e}.{hf}.weight" for e in range(args.n_experts)])
        n = args.n_experts  # the balancing bias neither class has: zero, and refused on export once moved
        out[f"{ours}feed_forward.router.expert_bias"] = HFTensors((), lambda t: [], lambda ts, n=n: torch.zeros(n))
    return out


def ignored(args: LlamaArgs) -> set[str]:
    """Tensors a checkpoint may hold that we recompute (RoPE's frequencies) or tie (the head)."""
    names = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(args.n_layers)}
    return names | ({"lm_head.weight"} if args.tie_embeddings else set())


# ---- config: ours → transformers ----------------------------------------------------------------------

def rope_parameters(args: LlamaArgs) -> dict:
    """The model's RoPE settings as transformers names them (rope_type, rope_theta, factor, ...)."""
    return {"rope_type": "default" if args.rope_scaling == "none" else args.rope_scaling,
            "rope_theta": args.rope_theta, **(args.rope_scaling_params or {})}


def _moe_config(args: LlamaArgs) -> dict:
    if model_type(args) == "mixtral":
        return {"intermediate_size": args.expert_ffn_dim or args.ffn_dim, "num_local_experts": args.n_experts,
                "num_experts_per_tok": args.n_active_experts, "router_aux_loss_coef": args.moe_aux_loss,
                "router_jitter_noise": 0.0, "output_router_logits": False,
                "sliding_window": args.sliding_window or None}
    return {"intermediate_size": args.ffn_dim, "moe_intermediate_size": args.expert_ffn_dim or args.ffn_dim,
            "num_experts": args.n_experts, "num_experts_per_tok": args.n_active_experts,
            "norm_topk_prob": args.router_norm_topk, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(args.n_dense_layers)), "router_aux_loss_coef": args.moe_aux_loss,
            "output_router_logits": False}


def hf_config(args: LlamaArgs) -> dict:
    kind = model_type(args)
    scaling = rope_parameters(args) if args.rope_scaling != "none" else None
    config = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "rope_parameters": rope_parameters(args),
        "rope_scaling": scaling, "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": args.init_std,
        "pad_token_id": None, "use_cache": True,
    }
    if kind in ("qwen3", "qwen3_moe"):
        config |= {"use_sliding_window": False, "sliding_window": None}
    if kind == "mistral":
        config["sliding_window"] = args.sliding_window
    return config | (_moe_config(args) if args.n_experts else {})


def export_problems(args: LlamaArgs, state: dict) -> list[str]:
    """Every reason transformers' classes cannot hold the model (none: it exports)."""
    if args.sliding_window and (args.sliding_window_pattern or model_type(args) not in ("mistral", "mixtral")):
        return [f"cannot export model.sliding_window={args.sliding_window} to Hugging Face: only Mistral's and "
                "Mixtral's window on every layer is written (no pattern, QK-norm or q/k/v biases)"]
    if args.n_experts:
        return _moe_problems(args, state)
    problems = []
    if args.qk_norm and args.qkv_bias:
        problems.append("model.qk_norm=true with model.qkv_bias=true: Qwen3 has QK-norm but no q/k/v-only biases, "
                        "Qwen2 the biases but no QK-norm")
    if args.attn_softcap > 0:
        problems.append(f"model.attn_softcap={args.attn_softcap}: Hugging Face's Llama has no attention soft-cap")
    if args.final_softcap > 0:
        problems.append(f"model.final_softcap={args.final_softcap}: Hugging Face's Llama has no logit soft-cap")
    return [f"cannot export to the Hugging Face Llama format: {p}" for p in problems]


def _moe_problems(args: LlamaArgs, state: dict) -> list[str]:
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
    if args.n_shared_experts or args.router_score == "sigmoid":
        problems.append("DeepSeek-V3's class has shared experts and sigmoid routing, but its attention is multi-head "
                        "latent attention, which ultratron does not implement")
    return [f"cannot export this mixture of experts to Hugging Face: {p}" for p in problems]


# ---- config: transformers → ours ----------------------------------------------------------------------

def _rope(hf: dict) -> tuple[float, str, dict, list[str]]:
    """(rope_theta, our scaling name, its numbers, problems) from rope_parameters or rope_scaling."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        return theta, "none", {}, [f"rope scaling type {kind!r}: ultratron implements "
                                   f"{', '.join(ROPE_TYPES)} only"]
    numbers = {k: float(params[k]) for k in ROPE_NUMBERS.get(kind, ()) if params.get(k) is not None}
    missing = [k for k in ROPE_NUMBERS.get(kind, ()) if k not in numbers]
    return theta, ROPE_TYPES[kind], numbers, [f"rope scaling {kind!r} lacks {k}" for k in missing]


def _experts_from_hf(hf: dict, kind: str, n_layers: int) -> tuple[dict, list[str]]:
    """The mixture-of-experts fields of a Mixtral or Qwen3-MoE config.json."""
    n_experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
    fields = {"n_experts": n_experts, "n_active_experts": int(hf["num_experts_per_tok"]), "router_score": "softmax",
              "n_shared_experts": 0, "moe_aux_loss": float(hf.get("router_aux_loss_coef", 0.01))}
    if kind == "mixtral":
        return fields | {"expert_ffn_dim": int(hf["intermediate_size"]), "router_norm_topk": True}, []
    step, only = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or [])
    dense = [i for i in range(n_layers) if i in only or not (n_experts > 0 and (i + 1) % step == 0)]
    problems = []
    if dense != list(range(len(dense))):
        problems.append(f"dense layers {dense} (mlp_only_layers, decoder_sparse_step): ultratron keeps only the "
                        "first layers dense")
    if int(hf.get("shared_expert_intermediate_size") or 0):
        problems.append("shared_expert_intermediate_size: ultratron's Qwen3-MoE has no shared expert")
    return fields | {"expert_ffn_dim": int(hf["moe_intermediate_size"]), "n_dense_layers": len(dense),
                     "router_norm_topk": bool(hf.get("norm_topk_prob", False))}, problems


def config_from_hf(hf: dict, max_seq_len: int | None = None) -> tuple[dict, list[str]]:
    """ModelConfig fields for a transformers config.json, and every reason it does not map."""
    kind = hf.get("model_type")
    if kind in REFUSED:
        return {}, [REFUSED[kind]]
    if kind not in ARCHITECTURES:
        return {}, [f"model_type {kind!r} is not a Llama-family model ultratron can hold "
                    f"(supported: {', '.join(ARCHITECTURES)})"]
    p: list[str] = []
    dim, heads, n_layers = int(hf["hidden_size"]), int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
    context = int(hf.get("max_position_embeddings", 2048))
    if max_seq_len is not None:
        context = min(context, max_seq_len)
    theta, scaling, scaling_params, rope_problems = _rope(hf)
    p += rope_problems
    fields = {
        "preset": None, "n_layers": n_layers, "dim": dim, "n_heads": heads,
        "n_kv_heads": int(hf.get("num_key_value_heads") or heads), "ffn_dim": int(hf["intermediate_size"]),
        "vocab_size": int(hf["vocab_size"]), "max_seq_len": context,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "rope_theta": theta,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "init_std": float(hf.get("initializer_range", 0.02)),
        "qkv_bias": kind == "qwen2", "rope_scaling": scaling, "rope_scaling_params": scaling_params,
        "head_dim": int(hf.get("head_dim") or dim // heads), "qk_norm": kind in ("qwen3", "qwen3_moe"),
        "n_experts": 0,
    }
    if kind in EXPERT_NAMES:
        moe, moe_problems = _experts_from_hf(hf, kind, n_layers)
        fields |= moe
        p += moe_problems
    if hf.get("hidden_act", "silu") != "silu":
        p.append(f"hidden_act {hf['hidden_act']!r}: ultratron's feed-forward is SwiGLU (silu)")
    if hf.get("attention_bias"):
        p.append("attention_bias=true: ultratron's Llama has no biases on the attention projections")
    if hf.get("mlp_bias"):
        p.append("mlp_bias=true: ultratron's feed-forward has no biases")
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        p.append(f"partial_rotary_factor={hf['partial_rotary_factor']}: ultratron rotates every channel")
    window = hf.get("sliding_window")
    uses_window = window is not None and (kind in ("mistral", "mixtral") or hf.get("use_sliding_window", False))
    full_layers = int(hf.get("max_window_layers", 0)) if kind not in ("mistral", "mixtral") else 0
    if uses_window and int(window) < context and full_layers < n_layers:
        if full_layers:  # Qwen2: the first max_window_layers attend fully, the rest through the window
            p.append(f"sliding_window={window} on layers {full_layers}.. only (max_window_layers): ultratron's "
                     f"windows are on every layer or every N-th full; import with --max-seq-len {window} "
                     "(within the window the two are identical)")
        else:
            fields["sliding_window"] = int(window)  # on every layer (Mistral)
    if hf.get("quantization_config"):
        p.append("quantized weights (quantization_config): import an unquantized model")
    return fields, p


ADAPTER = HFAdapter(architectures=ARCHITECTURES, config_from_hf=config_from_hf, hf_config=hf_config,
                    export_problems=export_problems, weight_map=weight_map, args_from_config=LlamaArgs.from_config,
                    refused=REFUSED, ignored=ignored)
