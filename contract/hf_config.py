"""transformers' config.json <-> DecoderConfig, for every model_type kvserve implements. No torch here: the
torch-free server reads an artifact's config.json through it too.

Whatever a config.json asks for that kvserve does not implement is refused by name (a rope type, an
activation, a bidirectional Gemma), never silently approximated.
"""

from __future__ import annotations

import json
import math

from .config import GPT2_ARCH, MODEL_TYPES, SIZE_LIMIT, DecoderConfig, RopeScaling

HF_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                    "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
GEMMA_TYPES = ("gemma2", "gemma3_text")
# transformers' defaults where a Gemma config.json leaves a field out.
_GEMMA_DEFAULTS = {
    "gemma2": {"rope_theta": 10000.0, "window_pattern": 2, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": {"rope_theta": 1000000.0, "window_pattern": 6, "final_logit_softcapping": None},
}
# The rope_scaling fields each type reads, beside rope_type and factor (written back as read).
_ROPE_FIELDS = {
    "linear": (),
    "dynamic": (),
    "llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"),
    "longrope": ("original_max_position_embeddings", "attention_factor", "short_factor", "long_factor"),
}


# The numeric fields read from a config.json: one that holds anything but a finite number is named (int("x") names no
# field, int(Infinity) overflows), and a count or size that is not a whole number too (int(0.5) heads would be 0).
NUMBER_FIELDS = ("vocab_size", "n_embd", "n_head", "n_layer", "n_positions", "n_ctx", "n_inner", "layer_norm_epsilon", "hidden_size",
                 "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "intermediate_size", "max_position_embeddings",
                 "head_dim", "rms_norm_eps", "rope_theta", "partial_rotary_factor", "original_max_position_embeddings", "sliding_window",
                 "max_window_layers", "sliding_window_pattern", "query_pre_attn_scalar", "attn_logit_softcapping",
                 "final_logit_softcapping", "rope_local_base_freq", "no_rope_layer_interval", "initializer_range")
# {field: its least value}; every one below config.SIZE_LIMIT.
WHOLE_NUMBER_FIELDS = dict.fromkeys(("vocab_size", "n_embd", "n_head", "n_layer", "n_positions", "n_ctx", "hidden_size", "num_attention_heads",
                                     "num_key_value_heads", "num_hidden_layers", "intermediate_size", "max_position_embeddings", "head_dim"), 1) | {
    "original_max_position_embeddings": 2, "n_inner": 0, "max_window_layers": 0, "sliding_window_pattern": 0,
    "no_rope_layer_interval": 0}


class GenerationConfigError(ValueError):
    """A generation_config.json field that cannot be read (its reader names that file, not config.json)."""


def _token_ids(value) -> tuple[int, ...]:
    """An eos_token_id field (an id, a list of them, or null) as ids; a float or a string is refused, not rounded."""
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"eos_token_id must be a token id or a list of them, got {json.dumps(value)[:40]}")
    return tuple(ids)


def config_from_hf(hf: dict, generation: dict | None = None) -> DecoderConfig:
    """A config.json (and, when given, generation_config.json, whose eos_token_id wins) as a DecoderConfig."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unsupported architecture: model_type {model_type!r} (kvserve implements {', '.join(MODEL_TYPES)})")
    for key in NUMBER_FIELDS:
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
            raise ValueError(f"{key} must be a number, got {json.dumps(value)[:40]}")
        if value is not None and key in WHOLE_NUMBER_FIELDS and not (value == int(value) and WHOLE_NUMBER_FIELDS[key] <= value < SIZE_LIMIT):
            raise ValueError(f"{key} must be a whole number in [{WHOLE_NUMBER_FIELDS[key]}, {SIZE_LIMIT}), got {value}")
    if generation is not None and "eos_token_id" in generation:
        try:
            eos_ids = _token_ids(generation["eos_token_id"])
        except ValueError as exc:
            raise GenerationConfigError(str(exc)) from None
    else:
        eos_ids = _token_ids(hf.get("eos_token_id"))
    vocab_size = _required(hf, "vocab_size")
    # An id the model can never emit: transformers tolerates it, and so do we.
    eos_ids = tuple(dict.fromkeys(i for i in eos_ids if 0 <= i < vocab_size))
    bos = hf.get("bos_token_id")
    common = dict(
        model_type=model_type,
        vocab_size=vocab_size,
        eos_token_ids=eos_ids,
        bos_token_id=int(bos) if isinstance(bos, int) and 0 <= bos < vocab_size else None,
        initializer_range=float(hf.get("initializer_range", 0.02)),
    )
    if model_type == GPT2_ARCH:
        return _gpt2_from_hf(hf, common | {"bos_token_id": None})  # GPT-2's is its EOS; config_to_hf writes it so
    return _llama_from_hf(hf, common)


def config_to_hf(config: DecoderConfig) -> dict:
    """The config.json transformers' from_pretrained reads for this config."""
    eos = list(config.eos_token_ids)
    common = {
        "architectures": [HF_ARCHITECTURES[config.model_type]],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        # GPT-2's BOS is its EOS (its config.json says so); the Llama family's is its own, or none.
        "bos_token_id": config.eos_token_id if config.model_type == GPT2_ARCH else config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "initializer_range": config.initializer_range,
        "tie_word_embeddings": config.tie_word_embeddings,
    }
    if config.model_type == GPT2_ARCH:
        return common | {
            "activation_function": "gelu_new",
            "n_positions": config.n_ctx,
            "n_embd": config.d_model,
            "n_head": config.n_head,
            "n_layer": config.n_layer,
            "n_inner": config.d_mlp,
            "layer_norm_epsilon": config.layer_norm_eps,
            "resid_pdrop": config.dropout,
            "embd_pdrop": config.dropout,
            "attn_pdrop": config.dropout,
        }
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        scaling = config.rope_scaling
        rope = {"rope_type": scaling.rope_type, "rope_theta": config.rope_theta, "factor": scaling.factor}
        rope |= {name: getattr(scaling, name) for name in _ROPE_FIELDS[scaling.rope_type] if getattr(scaling, name) not in (None, ())}
        rope = {name: list(value) if isinstance(value, tuple) else value for name, value in rope.items()}
    if config.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = config.partial_rotary_factor
    hf = common | {
        "hidden_act": config.hidden_act,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_mlp,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim,
        "num_hidden_layers": config.n_layer,
        "max_position_embeddings": config.n_ctx,
        "rms_norm_eps": config.layer_norm_eps,
        # Both spellings: transformers 5 reads rope_parameters, transformers 4 (and most published configs) rope_theta/rope_scaling.
        "rope_parameters": rope,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"},
        "attention_dropout": config.dropout,
    }
    if config.partial_rotary_factor != 1.0:
        hf["partial_rotary_factor"] = config.partial_rotary_factor
    if config.model_type in GEMMA_TYPES:
        hf |= _gemma_to_hf(config, rope)
    elif config.model_type == "phi3":
        original = config.rope_scaling.original_max_position_embeddings if config.rope_scaling is not None else None
        hf |= {"sliding_window": config.sliding_window, "original_max_position_embeddings": original or config.n_ctx}
    elif config.model_type == "llama":
        hf |= {"attention_bias": config.qkv_bias, "mlp_bias": config.mlp_bias}
    elif config.model_type in ("qwen2", "qwen3", "smollm3"):
        layer_types = ["sliding_attention" if config.window(i) else "full_attention" for i in range(config.n_layer)]
        hf |= {"use_sliding_window": config.sliding_window is not None, "sliding_window": config.sliding_window,
               "max_window_layers": config.n_layer if config.sliding_window is None else min(config.sliding_layers), "layer_types": layer_types}
        if config.model_type in ("qwen3", "smollm3"):
            hf |= {"attention_bias": config.qkv_bias}
        if config.model_type == "smollm3":
            hf |= {"mlp_bias": config.mlp_bias, "no_rope_layers": [int(i not in config.nope_layers) for i in range(config.n_layer)]}
    else:
        if config.sliding_window is not None and len(config.sliding_layers) != config.n_layer:
            raise ValueError("a Mistral config.json slides every layer or none; this config slides some")
        hf |= {"sliding_window": config.sliding_window}
    return hf


def _gemma_to_hf(config: DecoderConfig, rope: dict) -> dict:
    layer_types = ["sliding_attention" if config.window(i) else "full_attention" for i in range(config.n_layer)]
    hf = {"hidden_activation": config.hidden_act, "attention_bias": config.qkv_bias, "query_pre_attn_scalar": config.query_pre_attn_scalar,
          "sliding_window": config.sliding_window, "layer_types": layer_types, "final_logit_softcapping": config.final_logit_softcapping,
          "attn_logit_softcapping": config.attn_logit_softcapping}
    if config.model_type == "gemma3_text":  # two bases: transformers 5 nests them by layer type, 4 names the local one apart
        local = {"rope_type": "default", "rope_theta": config.local_rope_theta}
        hf |= {"rope_parameters": {"full_attention": rope, "sliding_attention": local}, "rope_local_base_freq": config.local_rope_theta}
    return hf


def _required(hf: dict, key: str) -> int:
    if key not in hf or hf[key] is None:
        raise ValueError(f"config.json lacks required field {key!r}")
    return int(hf[key])


def _gpt2_from_hf(hf: dict, common: dict) -> DecoderConfig:
    unsupported = {
        "activation_function": ("gelu_new", hf.get("activation_function", "gelu_new")),
        "scale_attn_weights": (True, hf.get("scale_attn_weights", True)),
        "scale_attn_by_inverse_layer_idx": (False, hf.get("scale_attn_by_inverse_layer_idx", False)),
        "reorder_and_upcast_attn": (False, hf.get("reorder_and_upcast_attn", False)),
        "add_cross_attention": (False, hf.get("add_cross_attention", False)),
        "tie_word_embeddings": (True, hf.get("tie_word_embeddings", True)),
    }
    for key, (expected, actual) in unsupported.items():
        if actual != expected:
            raise ValueError(f"unsupported GPT-2 variant: {key}={actual!r} (kvserve implements {key}={expected!r})")
    missing = [k for k in ("n_embd", "n_head", "n_layer") if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks required field(s): {', '.join(missing)}")
    d_model = int(hf["n_embd"])
    return DecoderConfig(
        **common,
        n_ctx=int(hf.get("n_positions", hf.get("n_ctx", 1024))),
        d_model=d_model,
        n_head=int(hf["n_head"]),
        n_layer=int(hf["n_layer"]),
        d_mlp=int(hf.get("n_inner") or 4 * d_model),
        layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
    )


def _object(hf: dict, key: str) -> dict:
    """A field that holds an object (rope_parameters, rope_scaling), {} when absent or null."""
    value = hf.get(key) or {}
    if not isinstance(value, dict):  # its readers look fields up in it
        raise ValueError(f"{key} must be an object, got {json.dumps(value)[:40]}")
    return value


def _rope(hf: dict, default_theta: float = 10000.0) -> tuple[float, RopeScaling | None, float]:
    """rope_theta, the scaling and the partial rotary factor, from transformers 5's rope_parameters (Gemma 3's: its
    full_attention entry) or the older rope_theta/rope_scaling."""
    parameters = _object(hf, "rope_parameters")
    parameters = parameters.get("full_attention") or parameters if isinstance(parameters.get("full_attention"), dict) else parameters
    if "rope_theta" in parameters or "rope_type" in parameters:
        theta, scaling = parameters.get("rope_theta", hf.get("rope_theta", default_theta)), parameters
    else:
        theta, scaling = hf.get("rope_theta", default_theta), _object(hf, "rope_scaling")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if hf.get("model_type") == "phi3" and rope_type in ("su", "yarn"):  # Phi-3's early names for its longrope, as transformers reads them
        rope_type = "longrope"
    partial = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if not isinstance(partial, (int, float)) or isinstance(partial, bool) or not 0 < partial <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial!r}")
    if rope_type == "default":
        return float(theta), None, float(partial)
    if rope_type not in _ROPE_FIELDS:
        raise ValueError(f"unsupported rope_type {rope_type!r} (kvserve implements 'default', {', '.join(map(repr, _ROPE_FIELDS))})")
    fields = {name: scaling[name] for name in _ROPE_FIELDS[rope_type] if scaling.get(name) is not None}
    original = scaling.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    if rope_type in ("yarn", "longrope"):
        # Both fall back to the config's own original_max_position_embeddings (Phi-3 keeps it beside rope_scaling), and a
        # missing factor is the context's ratio to it (the attention factor follows from it), written out.
        if original is None:
            raise ValueError(f"rope_scaling of type {rope_type!r} lacks original_max_position_embeddings")
        if isinstance(original, bool) or not isinstance(original, (int, float)) or not 2 <= original < SIZE_LIMIT or original != int(original):
            raise ValueError(f"rope_scaling's original_max_position_embeddings must be a whole number in [2, {SIZE_LIMIT}), "
                             f"got {json.dumps(original)[:40]}")
        fields["original_max_position_embeddings"] = int(original)
        if scaling.get("factor") is None:
            scaling = scaling | {"factor": _required(hf, "max_position_embeddings") / int(original)}
    if rope_type == "longrope":
        missing = [name for name in ("short_factor", "long_factor") if not isinstance(scaling.get(name), list)]
        if missing:
            raise ValueError(f"rope_scaling of type 'longrope' lacks {', '.join(missing)} (a list of numbers each)")
    if rope_type in ("linear", "dynamic"):
        fields["original_max_position_embeddings"] = None  # they need none (RopeScaling's default is llama3's)
    required = ("factor", *_ROPE_FIELDS["llama3"]) if rope_type == "llama3" else ("factor",)
    missing = [name for name in required if scaling.get(name) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks {', '.join(missing)}")
    kinds = {"original_max_position_embeddings": int, "truncate": bool, "short_factor": tuple, "long_factor": tuple}
    try:
        fields = {name: value if value is None else kinds.get(name, float)(value) for name, value in fields.items()}
        scaling_fields = RopeScaling(rope_type=rope_type, factor=float(scaling["factor"]), **fields)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"rope_scaling of type {rope_type!r}: {exc}") from None
    return float(theta), scaling_fields, float(partial)


def _llama_from_hf(hf: dict, common: dict) -> DecoderConfig:
    model_type = hf["model_type"]
    n_ctx = _required(hf, "max_position_embeddings")
    theta, scaling, partial = _rope(hf, _GEMMA_DEFAULTS[model_type]["rope_theta"] if model_type in GEMMA_TYPES else 10000.0)
    gemma = model_type in GEMMA_TYPES
    act = hf.get("hidden_activation") or hf.get("hidden_act", "gelu_pytorch_tanh" if gemma else "silu")
    if act != ("gelu_pytorch_tanh" if gemma else "silu"):
        raise ValueError(f"unsupported hidden_act {act!r} (kvserve implements {model_type}'s "
                         f"{'GeGLU MLP: gelu_pytorch_tanh' if gemma else 'SwiGLU MLP: silu'})")
    if hf.get("pretraining_tp", 1) != 1:
        raise ValueError(f"unsupported pretraining_tp {hf['pretraining_tp']!r} (kvserve implements 1)")
    n_layer = _required(hf, "num_hidden_layers")
    window, sliding_layers = _sliding_window(hf, n_ctx, n_layer)
    d_model, n_head = _required(hf, "hidden_size"), _required(hf, "num_attention_heads")
    attention_bias = bool(hf.get("attention_bias", False))
    return DecoderConfig(
        **common,
        n_ctx=n_ctx,
        d_model=d_model,
        n_head=n_head,
        n_layer=n_layer,
        d_mlp=_required(hf, "intermediate_size"),
        layer_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        n_kv_head=int(hf.get("num_key_value_heads") or n_head),
        head_dim=int(hf.get("head_dim") or d_model // n_head),
        rope_theta=theta,
        rope_scaling=scaling,
        # Qwen2 always biases Q, K and V (not O); Llama, Qwen3, SmolLM3 and Gemma all four when attention_bias; Mistral and Phi-3 none.
        qkv_bias=model_type == "qwen2" or (model_type in ("llama", "qwen3", "smollm3", *GEMMA_TYPES) and attention_bias),
        o_bias=model_type in ("llama", "qwen3", "smollm3", *GEMMA_TYPES) and attention_bias,
        mlp_bias=model_type in ("llama", "smollm3") and bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma or model_type == "smollm3")),  # transformers' defaults
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        sliding_window=window,
        sliding_layers=sliding_layers,
        partial_rotary_factor=partial,
        nope_layers=_nope_layers(hf, n_layer),
        **(_gemma_from_hf(hf) if gemma else {}),
    )


def _gemma_from_hf(hf: dict) -> dict:
    """What Gemma 2 and 3 add to the Llama family: (1 + weight) norms, scaled embeddings, a norm after each branch too,
    their own attention scale, soft caps (both of Gemma 2's, Gemma 3's final one) and the sliding layers' RoPE base (Gemma 3)."""
    model_type, defaults = hf["model_type"], _GEMMA_DEFAULTS[hf["model_type"]]
    if hf.get("use_bidirectional_attention"):
        raise ValueError("unsupported use_bidirectional_attention: true (kvserve implements causal decoders)")
    fields = dict(hidden_act="gelu_pytorch_tanh", norm_weight_offset=1.0, embed_scale=True, sandwich_norms=True,
                  query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)))
    # Gemma 3 keeps attn_logit_softcapping in its config but caps no attention scores: transformers' Gemma3Attention
    # never hands it to its attention (Q/K norms bound them), so a checkpoint that sets it was trained and evaluated
    # uncapped. Its final logit cap is applied, as there.
    caps = ("final_logit_softcapping", "attn_logit_softcapping") if model_type == "gemma2" else ("final_logit_softcapping",)
    for cap in caps:
        value = hf.get(cap, defaults[cap])
        fields[cap] = None if value is None else float(value)
    if model_type == "gemma3_text":
        local = _object(hf, "rope_parameters").get("sliding_attention") or {}
        if not isinstance(local, dict):
            raise ValueError(f"rope_parameters' sliding_attention must be an object, got {json.dumps(local)[:40]}")
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope_type {local['rope_type']!r} for sliding_attention layers (kvserve turns them by 'default')")
        fields["local_rope_theta"] = float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
    return fields


def _nope_layers(hf: dict, n_layer: int) -> tuple[int, ...]:
    """SmolLM3's layers without rotation: no_rope_layers says 1 for a layer that rotates (transformers' meaning), by
    default every no_rope_layer_interval'th does not."""
    if hf["model_type"] != "smollm3":
        return ()
    interval = int(hf.get("no_rope_layer_interval", 4))
    uses_rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n_layer)]
    if len(uses_rope) != n_layer:
        raise ValueError(f"no_rope_layers must have one entry per layer ({n_layer}), got {len(uses_rope)}")
    return tuple(i for i, rotates in enumerate(uses_rope) if not rotates)


def _sliding_window(hf: dict, n_ctx: int, n_layer: int) -> tuple[int | None, tuple[int, ...]]:
    """The window and the layers it applies to, as transformers reads them: Mistral's and Phi-3's apply to every layer;
    Qwen2's, Qwen3's and SmolLM3's only with use_sliding_window, to the layers layer_types calls sliding_attention (by
    default those from max_window_layers on; SmolLM3's, those without rotation); Gemma's to the layers layer_types
    names. A window covering the whole context is no window."""
    window = hf.get("sliding_window")
    if window is None:
        return None, ()
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    if hf["model_type"] in ("mistral", "phi3"):
        layers = tuple(range(n_layer))
    elif hf["model_type"] in GEMMA_TYPES:  # every layer_types'th layer global, the others sliding, unless layer_types says
        pattern = int(hf.get("sliding_window_pattern", _GEMMA_DEFAULTS[hf["model_type"]]["window_pattern"]))
        layer_types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layer)]
        if len(layer_types) != n_layer or set(layer_types) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"layer_types must name each of the {n_layer} layers sliding_attention or full_attention")
        layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    elif hf["model_type"] in ("qwen2", "qwen3", "smollm3"):
        if not hf.get("use_sliding_window", False):
            return None, ()
        layer_types = hf.get("layer_types")
        if layer_types is None and hf["model_type"] == "smollm3":  # its layers without rotation slide
            nope = _nope_layers(hf, n_layer)
            layer_types = ["sliding_attention" if i in nope else "full_attention" for i in range(n_layer)]
        elif layer_types is None:
            first = int(hf.get("max_window_layers", 28))
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layer)]
        if len(layer_types) != n_layer or set(layer_types) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"layer_types must name each of the {n_layer} layers sliding_attention or full_attention")
        layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    else:  # Llama's config has no window; one written there anyway is read by nothing in transformers either
        return None, ()
    if window >= n_ctx or not layers:
        return None, ()
    return int(window), layers
