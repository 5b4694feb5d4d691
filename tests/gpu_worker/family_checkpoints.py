"""Tiny random checkpoints of each supported family, built with transformers' own config and
model classes (nothing downloaded), saved as HF folders; and their HF greedy reference."""

from __future__ import annotations

import torch
import transformers

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
               # wide weights: greedy margins far above float32 rounding, so ties cannot flip a token
               initializer_range=0.25)
LLAMA3_ROPE = {"rope_theta": 10000.0, "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# name -> (config class, model class, what sets it apart from the others)
FAMILIES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=True)),
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
               dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False, eos_token_id=[2, 3])),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(head_dim=16, sliding_window=None, tie_word_embeddings=False)),
    # Phi-4-mini's shape: fused qkv/gate_up, longrope, rope on 3/4 of each head
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        max_position_embeddings=512, original_max_position_embeddings=128, tie_word_embeddings=False,
        pad_token_id=0, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                         "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                         "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]})),
    # Gemma: sliding window 8 (the prompts are 19-42 tokens), scale apart from head_dim, strong caps
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0, num_hidden_layers=3, pad_token_id=0)),
    # Gemma 3: sliding layers at their own rope base; the full one's scaled linearly
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=8, num_hidden_layers=3, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})),
}
GGUF_FAMILIES = sorted(FAMILIES)
# what a GGUF can say (llama.cpp's Gemma converters): query_pre_attn_scalar is head_dim (below 27B),
# Gemma 3's layers slide but every 6th
GGUF_SHAPES = {"gemma2": dict(query_pre_attn_scalar=16),
               "gemma3": dict(query_pre_attn_scalar=16, num_hidden_layers=6, layer_types=None)}


def hf_checkpoint(name: str, seed: int = 0, **overrides):
    """A random float32 transformers model of the family, eval mode."""
    config_class, model_class, extra = FAMILIES[name]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**_COMMON, **extra, **overrides})).eval()
    if name.startswith("gemma"):  # its norms start at w = 0, scaling by (1 + w): make w count
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith("norm.weight"):
                    param.normal_(std=0.3)
    return model


def gguf_checkpoint(name: str, seed: int = 0, **overrides):
    """hf_checkpoint in a shape a GGUF header can describe."""
    return hf_checkpoint(name, seed, **{**GGUF_SHAPES.get(name, {}), **overrides})


def save_checkpoint(name: str, directory, seed: int = 0, **overrides):
    """Write the checkpoint's HF folder (config.json, generation_config.json, safetensors)."""
    model = hf_checkpoint(name, seed, **overrides)
    model.save_pretrained(directory)
    return model


# a servable folder's eos ids, each declared in one place only as real models do: config.json
# (Qwen base: <|endoftext|>; Llama 3: <|end_of_text|>), tokenizer_config.json (the chat turn's
# end) and generation_config.json (both)
SERVABLE = {"qwen2": ("qwen", 0, [2, 0]), "qwen3": ("qwen", 0, [0]), "llama3": ("llama3", 1, [1, 4]),
            "gemma3": ("gemma", 1, [1, 4])}


def save_servable(name: str, directory, seed: int = 0, **overrides):
    """A whole model folder: the checkpoint (vocab 320) and its own tokenizer and chat template.
    Returns (transformers model, transformers tokenizer)."""
    from tests.gpu_worker.family_tokenizers import build_tokenizer

    style, config_eos, generation_eos = SERVABLE[name]
    tokenizer = build_tokenizer(style)
    bos = tokenizer.bos_token_id
    model = save_checkpoint(name, directory, seed, vocab_size=len(tokenizer), eos_token_id=config_eos,
                            bos_token_id=bos, pad_token_id=tokenizer.pad_token_id, **overrides)
    if style == "gemma":  # a random model rarely ends a turn: lengthen its tied <end_of_turn> row
        with torch.no_grad():
            model.get_input_embeddings().weight[tokenizer.convert_tokens_to_ids("<end_of_turn>")] *= 2.0
        model.save_pretrained(directory)
    model.generation_config.eos_token_id = generation_eos
    model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens (no cache, no stop): the whole sequence re-run per token."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
