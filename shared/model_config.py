"""The shape of a decoder of one of the families (model_families.py), from an HF config.json or a
GGUF header (same result)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

from pagedserve.shared.gemma_config import gguf_gemma_fields, hf_gemma_fields
from pagedserve.shared.model_families import family, gguf_family

# rope types the model implements; anything else is refused at load time, not silently wrong.
# freq_factors: a GGUF's rope_freqs tensor (llama3 scaling precomputed: inv_freq / factors)
# longrope (Phi-3): its short factors, the context capped to the original (longer ones switch
# to the long factors for the whole sequence in transformers, which a paged cache cannot redo)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "longrope")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None for plain rope; else has "rope_type" ("linear"|"llama3")
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"  # the family (model_families.py)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k (weights [head_dim]) before rope
    partial_rotary_factor: float = 1.0  # rope turns the first rotary_dim dims of each head only
    hidden_act: str = "silu"  # the MLP's gate activation, one of HIDDEN_ACTS
    # Gemma 2/3 (model_families.py's gemma switch); the defaults are every other family's
    norm_offset: float = 0.0  # RMSNorms scale by (norm_offset + weight), in float32
    sandwich_norms: bool = False  # a norm after attention, and before and after the MLP
    embed_scale: float = 1.0  # embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # attention scale is its ** -0.5 (else head_dim's)
    attn_softcap: float | None = None  # attention scores become cap * tanh(score / cap)
    final_softcap: float | None = None  # and so do the logits
    sliding_window: int | None = None  # keys t - p < window for the layers layer_types says slide
    layer_types: list[str] | None = None  # "sliding_attention" | "full_attention" per layer; None: all full
    rope_local_theta: float | None = None  # the sliding layers' rope base (Gemma 3); None: rope_theta
    # the config.json or GGUF key the context comes from (not compared: a folder equals its GGUF)
    context_field: str = field(default="max_position_embeddings", compare=False)

    def context_length(self, max_model_len: int | None) -> int:
        """--max-model-len, or the model's context; refuses one longer, naming where that comes from."""
        if max_model_len is None:
            return self.max_position_embeddings
        if max_model_len > self.max_position_embeddings:
            raise ValueError(f"--max-model-len {max_model_len} exceeds this model's context of "
                             f"{self.max_position_embeddings} tokens (its {self.context_field})")
        return max_model_len

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer, None where it attends to the whole context."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"rope_scaling type {rope_type!r} not supported (have {SUPPORTED_ROPE_TYPES})")

    @staticmethod
    def from_hf_config(config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """From a config.json dict (and optionally generation_config.json, whose eos ids are merged)."""
        fam = family(config.get("model_type", "llama"))
        if config.get("mlp_bias"):
            raise ValueError("mlp_bias=true not supported")
        hidden_act = config.get("hidden_activation") or config.get("hidden_act", "silu")
        if hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act {hidden_act!r} not supported for {fam.name} ({', '.join(HIDDEN_ACTS)})")
        if fam.gemma:
            gemma = hf_gemma_fields(config, fam)
            config = {**config, "rope_parameters": gemma.pop("rope_parameters")}
        else:
            gemma = {}
        attention_bias = bool(config.get("attention_bias"))
        num_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        rope_theta, rope_scaling, partial_rotary_factor = _hf_rope(config)
        context, context_field = _served_context(config, fam, rope_scaling)
        eos = _as_id_list(config.get("eos_token_id"))
        for token_id in _as_id_list((generation_config or {}).get("eos_token_id")):
            if token_id not in eos:
                eos.append(token_id)
        return ModelConfig(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=context,
            context_field=context_field,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", fam.gemma)),  # Gemma's default: tied
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos,
            architecture=fam.name,
            qkv_bias=fam.qkv_bias or attention_bias,
            o_bias=attention_bias,
            qk_norm=fam.qk_norm,
            partial_rotary_factor=partial_rotary_factor,
            hidden_act=hidden_act,
            **gemma,
        )

    @staticmethod
    def from_gguf(reader) -> ModelConfig:
        """From a gguf.GGUFReader's header (keys '<arch>.*' and 'tokenizer.ggml.*')."""
        arch = _field(reader, "general.architecture")
        fam = gguf_family(arch)
        tensors = {t.name: t for t in reader.tensors}
        hidden = _field(reader, f"{arch}.embedding_length")
        num_heads = _field(reader, f"{arch}.attention.head_count")
        rope_scaling = None
        scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
        elif scaling_type != "none":
            raise ValueError(f"GGUF rope scaling {scaling_type!r} not supported")
        if "rope_freqs.weight" in tensors:  # llama3 scaling, written out per dim pair
            factors = [float(x) for x in tensors["rope_freqs.weight"].data.reshape(-1)]
            rope_scaling = {"rope_type": "freq_factors", "factors": factors}
        context, context_field = int(_field(reader, f"{arch}.context_length")), f"{arch}.context_length"
        if "rope_factors_short.weight" in tensors:  # Phi-3's longrope: its factors as tensors
            original_key = f"{arch}.rope.scaling.original_context_length"
            rope_scaling = {"rope_type": "longrope", "original_max_position_embeddings": int(_field(reader, original_key)),
                            "attention_factor": float(_field(reader, f"{arch}.rope.scaling.attn_factor", 1.0)),
                            **{f"{kind}_factor": [float(x) for x in tensors[f"rope_factors_{kind}.weight"].data]
                               for kind in ("short", "long")}}
            if rope_scaling["original_max_position_embeddings"] < context:  # as from an HF folder
                context, context_field = rope_scaling["original_max_position_embeddings"], original_key
        window = _field(reader, f"{arch}.attention.sliding_window", None)
        if fam.window_without_flag and window and int(window) < context:
            context, context_field = int(window), f"{arch}.attention.sliding_window"
        # head_dim: key_length, else (Phi-3, whose rope turns part of each head) hidden / heads
        rotary_dim = _field(reader, f"{arch}.rope.dimension_count", None)
        head_dim = _field(reader, f"{arch}.attention.key_length",
                          hidden // num_heads if fam.fused_projections else rotary_dim or hidden // num_heads)
        vocab_size = _field(reader, f"{arch}.vocab_size", None)
        if vocab_size is None:
            vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
        eos = []
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            token_id = _field(reader, key, None)
            if token_id is not None and int(token_id) not in eos:
                eos.append(int(token_id))
        bos = _field(reader, "tokenizer.ggml.bos_token_id", None)
        gemma = gguf_gemma_fields(functools.partial(_field, reader), arch, fam, int(hidden), int(num_heads),
                                  int(head_dim), int(_field(reader, f"{arch}.block_count"))) if fam.gemma else {}
        return ModelConfig(
            vocab_size=int(vocab_size),
            hidden_size=int(hidden),
            intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
            num_layers=int(_field(reader, f"{arch}.block_count")),
            num_heads=int(num_heads),
            num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=int(head_dim),
            rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=context,
            context_field=context_field,
            tie_word_embeddings="output.weight" not in tensors,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos,
            architecture=fam.name,
            qkv_bias="blk.0.attn_q.bias" in tensors,
            o_bias="blk.0.attn_output.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            partial_rotary_factor=int(rotary_dim or head_dim) / int(head_dim),
            **gemma,
        )


def _field(reader, key: str, default: Any = KeyError) -> Any:
    """One GGUF header value as a python scalar/str/list; default (or KeyError) when absent."""
    if key not in reader.fields:
        if default is KeyError:
            raise KeyError(f"GGUF header lacks {key!r}")
        return default
    return reader.fields[key].contents()


def _served_context(config: dict[str, Any], fam, rope_scaling: dict | None) -> tuple[int, str]:
    """(context, the config.json field that sets it): max_position_embeddings, capped to the
    sliding window where any layer of a non-Gemma family slides (their layers attend to the whole
    context, which equals a window only while the context fits it) and to longrope's original
    context (past it transformers re-ropes the whole sequence)."""
    context, source = config.get("max_position_embeddings", 2048), "max_position_embeddings"
    if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
        if rope_scaling["original_max_position_embeddings"] < context:
            context, source = rope_scaling["original_max_position_embeddings"], "original_max_position_embeddings"
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if fam.gemma:  # its windows are masked by the attention
        return context, source
    if layer_types is not None:
        slides = "sliding_attention" in layer_types
    else:  # Mistral's and Phi-3's window applies to every layer; Qwen's only with use_sliding_window
        slides = config.get("use_sliding_window", fam.window_without_flag)
    return (int(window), "sliding_window") if slides and window and window < context else (context, source)


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _hf_rope(config: dict[str, Any]) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling or None, partial_rotary_factor) from `rope_parameters` or the
    older separate keys."""
    params = config.get("rope_parameters")
    if params is None:
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params = dict(params)
    if "type" in params and "rope_type" not in params:  # legacy spelling
        params["rope_type"] = params.pop("type")
    params.pop("type", None)
    rope_theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    partial = float(params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if params.get("rope_type", "default") == "default":
        return rope_theta, None, partial
    if params["rope_type"] == "longrope":  # transformers' defaults, from the unscaled context
        original = params.get("original_max_position_embeddings") or config["original_max_position_embeddings"]
        factor = params.get("factor") or config.get("max_position_embeddings", original) / original
        if params.get("attention_factor") is None:
            params["attention_factor"] = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        params["original_max_position_embeddings"] = original
    return rope_theta, params, partial
