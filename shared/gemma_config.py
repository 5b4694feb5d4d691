"""ModelConfig's Gemma 2/3 fields, from a config.json (as transformers reads it) or a GGUF header
(as llama.cpp reads what its convert_hf_to_gguf.py writes)."""

from __future__ import annotations

from typing import Any

# llama.cpp's defaults for what a Gemma GGUF header leaves out; the 27B models' block counts
_GGUF_GEMMA2_WINDOW, _GGUF_GEMMA2_ATTN_CAP, _GGUF_GEMMA2_FINAL_CAP = 4096, 50.0, 30.0
_GGUF_GEMMA3_LOCAL_THETA = 10000.0
_GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _common(hidden_size: int, layer_types: list[str] | None, **fields: Any) -> dict[str, Any]:
    return dict(norm_offset=1.0, sandwich_norms=True, embed_scale=hidden_size ** 0.5, layer_types=layer_types,
                **fields)


def _pattern_layers(num_layers: int, every: int) -> list[str]:
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(num_layers)]


def hf_gemma_fields(config: dict[str, Any], fam) -> dict[str, Any]:
    """ModelConfig's Gemma fields, and the full-attention layers' rope_parameters (Gemma 3 keeps one
    per layer type; older configs spell the local one rope_local_base_freq), as transformers reads them."""
    if config.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true not supported (a decoder attends causally)")
    every = config.get("sliding_window_pattern", fam.sliding_every)  # older configs' spelling
    layer_types = config.get("layer_types") or _pattern_layers(config["num_hidden_layers"], every)
    params = config.get("rope_parameters")
    local_theta = None
    if fam.name == "gemma3_text":
        local = {"rope_theta": float(config.get("rope_local_base_freq", 10000.0))}
        if params is None or "full_attention" not in params:
            params = dict(params or config.get("rope_scaling") or {})
            params.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
        else:
            params, local = dict(params["full_attention"]), params.get("sliding_attention") or local
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"sliding layers' rope_type {local['rope_type']!r} not supported (default)")
        local_theta = float(local["rope_theta"])
    scalar = config.get("query_pre_attn_scalar")
    return _common(
        config["hidden_size"], list(layer_types), rope_parameters=params,
        query_pre_attn_scalar=None if scalar is None else float(scalar),
        attn_softcap=config.get("attn_logit_softcapping"), final_softcap=config.get("final_logit_softcapping"),
        sliding_window=config.get("sliding_window"), rope_local_theta=local_theta)


def gguf_gemma_fields(field, arch: str, fam, hidden: int, num_heads: int, head_dim: int,
                      num_layers: int) -> dict[str, Any]:
    """The same from a GGUF header (field(key, default) reads a key): no query_pre_attn_scalar (head_dim,
    or hidden / heads at 27B), Gemma 3's local rope base 10000, no sliding_window where none slides."""
    window = field(f"{arch}.attention.sliding_window", _GGUF_GEMMA2_WINDOW if arch == "gemma2" else None)
    layer_types = _pattern_layers(num_layers, fam.sliding_every) if window else None
    if arch == "gemma2":
        attn_cap = field(f"{arch}.attn_logit_softcapping", _GGUF_GEMMA2_ATTN_CAP)
        final_cap = field(f"{arch}.final_logit_softcapping", _GGUF_GEMMA2_FINAL_CAP)
    else:  # Gemma 3 caps no scores
        attn_cap, final_cap = None, field(f"{arch}.final_logit_softcapping", None)
    scalar = hidden / num_heads if num_layers == _GGUF_27B_LAYERS.get(arch) else head_dim
    return _common(
        hidden, layer_types, hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=float(scalar),
        attn_softcap=None if attn_cap is None else float(attn_cap),
        final_softcap=None if final_cap is None else float(final_cap),
        sliding_window=int(window) if window else None,
        rope_local_theta=_GGUF_GEMMA3_LOCAL_THETA if arch == "gemma3" else None)
