"""The decoder families one model definition serves, and what sets each apart (as vLLM's
LlamaForCausalLM serves Qwen2/Mistral and llama.cpp's llm_build_* share one graph builder):
a family is a set of switches on that one model, never a model class of its own."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str  # HF config.json model_type
    gguf_arch: str  # GGUF general.architecture of the same weights
    qkv_bias: bool = False  # q/k/v projections always carry a bias (Qwen2), whatever attention_bias says
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3)
    # llama.cpp's converter interleaves Q/K rows for its GPT-J style rope on arch "llama" only;
    # NEOX-rope archs (qwen2, qwen3) keep HF's rotate-half rows
    gguf_rope_rows_permuted: bool = False
    fused_projections: bool = False  # the checkpoint holds qkv_proj and gate_up_proj (Phi-3), not their parts
    # config.json's sliding_window alone makes every layer slide (no use_sliding_window/layer_types)
    window_without_flag: bool = False
    # Gemma 2/3: (1 + w) norms, sandwich norms, scaled embeddings, GELU-tanh, query_pre_attn_scalar,
    # soft-capping, sliding layers masked by the attention (not the context capped)
    gemma: bool = False
    sliding_every: int = 0  # without layer_types: layer i slides unless (i + 1) % sliding_every == 0


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "llama", gguf_rope_rows_permuted=True),
    Family("mistral", "llama", gguf_rope_rows_permuted=True, window_without_flag=True),
    Family("qwen2", "qwen2", qkv_bias=True),
    Family("qwen3", "qwen3", qk_norm=True),
    Family("phi3", "phi3", fused_projections=True, window_without_flag=True),
    Family("gemma2", "gemma2", gemma=True, sliding_every=2),
    Family("gemma3_text", "gemma3", qk_norm=True, gemma=True, sliding_every=6),
)}
# a GGUF arch -> the family its tensors load as (Mistral GGUFs are arch "llama")
GGUF_ARCHS: dict[str, Family] = {f.gguf_arch: f for f in FAMILIES.values() if f.name != "mistral"}


def family(model_type: str) -> Family:
    """The family of an HF model_type; refuses any other, naming those supported."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} not supported (supported: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def gguf_family(arch: str) -> Family:
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} not supported (supported: {', '.join(GGUF_ARCHS)})")
    return GGUF_ARCHS[arch]
