"""One model definition for every family: each tiny random transformers checkpoint loads from its
HF folder with the right switches, and its logits equal transformers' within 1e-4 (a prefill, and
the same prompt in two chunks through the paged cache). Unsupported ones are refused by name."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers

from pagedserve.services.gpu_worker.kv_pool import KVPool
from pagedserve.services.gpu_worker.model.llama import build_model
from pagedserve.shared.model_config import ModelConfig
from pagedserve.shared.model_reader import load_config
from pagedserve.shared.tokenizer import load_tokenizer
from tests.gpu_worker.family_checkpoints import FAMILIES, SERVABLE, VOCAB, save_checkpoint, save_servable
from tests.gpu_worker.test_model import BLOCK_SIZE, BLOCK_TABLE, NUM_BLOCKS, run_step

SWITCHES = {  # family -> (architecture, qkv_bias, o_bias, qk_norm, tied)
    "qwen2": ("qwen2", True, False, False, True),
    "qwen3": ("qwen3", False, False, True, True),
    "llama3": ("llama", False, False, False, False),
    "mistral": ("mistral", False, False, False, False),
    "phi3": ("phi3", False, False, False, False),
    "gemma2": ("gemma2", False, False, False, True),
    "gemma3": ("gemma3_text", False, False, True, True),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_match_transformers(tmp_path, name):
    hf_model = save_checkpoint(name, tmp_path)
    model = build_model(str(tmp_path), dtype=torch.float32)
    c = model.config
    assert (c.architecture, c.qkv_bias, c.o_bias, c.qk_norm, c.tie_word_embeddings) == SWITCHES[name]
    assert load_config(str(tmp_path)) == c
    prompt = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    logits = model.compute_logits(run_step(model, KVPool(model.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype).kv_caches,
                                           [(prompt, 0, BLOCK_TABLE)]))
    assert (logits - expected).abs().max() < 1e-4
    kv_caches = KVPool(model.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype).kv_caches
    run_step(model, kv_caches, [(prompt[:25], 0, BLOCK_TABLE)])
    chunked = model.compute_logits(run_step(model, kv_caches, [(prompt[25:], 25, BLOCK_TABLE)]))
    assert (chunked - expected[25:]).abs().max() < 1e-4


def test_llama_attention_bias_adds_to_q_k_v_and_o(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    for name, p in hf_model.named_parameters():  # transformers zeroes biases at init
        if name.endswith("bias"):
            torch.nn.init.normal_(p, std=0.5)
    hf_model.save_pretrained(tmp_path)
    model = build_model(str(tmp_path))
    assert (model.config.qkv_bias, model.config.o_bias) == (True, True)
    prompt = list(range(3, 40))
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    logits = model.compute_logits(run_step(model, KVPool(model.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype).kv_caches,
                                           [(prompt, 0, BLOCK_TABLE)]))
    assert (logits - expected).abs().max() < 1e-4


@pytest.mark.parametrize(("name", "eos"), [("qwen2", [0, 2]), ("qwen3", [0, 2]), ("llama3", [1, 4])])
def test_a_folder_serves_its_own_tokenizer_template_and_every_eos(tmp_path, name, eos):
    """Stops on each eos id config.json, generation_config.json or tokenizer_config.json declares."""
    assert name in SERVABLE
    _, hf_tokenizer = save_servable(name, tmp_path)
    assert load_config(str(tmp_path)).eos_token_ids == eos
    tokenizer = load_tokenizer(str(tmp_path))
    assert set(tokenizer.eos_token_ids) == set(eos)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]
    assert tokenizer.apply_chat_template(messages) == list(
        hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    text = "héllo wörld 🎉 Paris"
    assert tokenizer.decode(tokenizer.encode(text)) == text


BASE = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=8192)


@pytest.mark.parametrize("model_type", ["gemma3", "gemma", "falcon"])
def test_unsupported_architecture_is_refused_naming_the_supported(model_type):
    with pytest.raises(ValueError, match=rf"model_type '{model_type}' not supported \(supported: llama, mistral, "
                                         r"qwen2, qwen3, phi3, gemma2, gemma3_text\)"):
        ModelConfig.from_hf_config({**BASE, "model_type": model_type})


def test_sliding_window_caps_the_context_where_a_layer_slides():
    """The paged kernels attend to the whole context: a window is exact only while the context fits it."""
    def context(**keys) -> int:
        return ModelConfig.from_hf_config({**BASE, **keys}).max_position_embeddings

    assert context(model_type="mistral", sliding_window=4096) == 4096
    assert context(model_type="mistral", sliding_window=None) == 8192
    assert context(model_type="qwen2", sliding_window=4096, use_sliding_window=False) == 8192
    assert context(model_type="qwen2", sliding_window=4096, layer_types=["full_attention"] * 2) == 8192
    assert context(model_type="qwen2", sliding_window=1024,
                   layer_types=["full_attention", "sliding_attention"]) == 1024
    assert context(model_type="phi3", sliding_window=2047) == 2047  # Phi-3-mini-4k
    longrope = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}
    assert context(model_type="phi3", original_max_position_embeddings=4096, rope_parameters=longrope) == 4096
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf_config({**BASE, "model_type": "llama", "hidden_act": "gelu"})


# config.json of google/gemma-3-1b-it and google/gemma-2-2b-it as first published (no layer_types,
# no rope_parameters), the shapes cut down
GEMMA3_1B = {**BASE, "model_type": "gemma3_text", "num_hidden_layers": 7, "hidden_size": 16, "head_dim": 8,
             "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "rope_theta": 1000000,
             "rope_local_base_freq": 10000, "rope_scaling": None, "sliding_window": 512,
             "sliding_window_pattern": 6, "final_logit_softcapping": None, "attn_logit_softcapping": None,
             "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0}
GEMMA2_2B = {**BASE, "model_type": "gemma2", "num_hidden_layers": 4, "hidden_size": 16, "head_dim": 8,
             "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
             "rope_theta": 10000.0, "sliding_window": 4096, "final_logit_softcapping": 30.0,
             "attn_logit_softcapping": 50.0, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


@pytest.mark.parametrize(("raw", "config_class"), [(GEMMA3_1B, transformers.Gemma3TextConfig),
                                                   (GEMMA2_2B, transformers.Gemma2Config)])
def test_gemma_configs_read_as_transformers_reads_them(raw, config_class):
    """A first-published config.json and transformers' own rewrite of it (layer_types, rope per
    layer type) give the same ModelConfig; sliding windows are masked, the context is not capped."""
    ours = ModelConfig.from_hf_config(raw)
    assert ModelConfig.from_hf_config(config_class(**raw).to_dict()) == ours
    assert ours.max_position_embeddings == 8192
    assert (ours.norm_offset, ours.sandwich_norms, ours.embed_scale, ours.query_pre_attn_scalar) == (1.0, True, 4.0, 256)
    if raw is GEMMA3_1B:
        assert ours.layer_types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
        assert (ours.rope_theta, ours.rope_local_theta, ours.sliding_window, ours.qk_norm) == (1e6, 1e4, 512, True)
        assert [ours.window(i) for i in (4, 5, 6)] == [512, None, 512]
    else:
        assert ours.layer_types == ["sliding_attention", "full_attention"] * 2
        assert (ours.rope_theta, ours.rope_local_theta, ours.attn_softcap, ours.final_softcap) == (1e4, None, 50, 30)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_config({**raw, "use_bidirectional_attention": True})


def test_a_max_model_len_past_the_models_context_is_refused_naming_its_field():
    def refusal(**keys) -> str:
        config = ModelConfig.from_hf_config({**BASE, **keys})
        assert config.context_length(None) == config.max_position_embeddings
        assert config.context_length(config.max_position_embeddings) == config.max_position_embeddings
        with pytest.raises(ValueError) as e:
            config.context_length(config.max_position_embeddings + 1)
        return str(e.value)

    assert refusal(model_type="llama") == ("--max-model-len 8193 exceeds this model's context of 8192 tokens "
                                           "(its max_position_embeddings)")
    assert refusal(model_type="mistral", sliding_window=4096).endswith("of 4096 tokens (its sliding_window)")
    longrope = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}
    assert refusal(model_type="phi3", original_max_position_embeddings=4096, rope_parameters=longrope).endswith(
        "(its original_max_position_embeddings)")
    assert refusal(model_type="gemma2", sliding_window=512).endswith("of 8192 tokens (its max_position_embeddings)")


@pytest.mark.parametrize(("device", "asked", "chosen"), [("cuda", "auto", "triton"), ("cpu", "auto", "torch"),
                                                         ("cuda", "reference", "reference"), ("cuda", "triton", "triton")])
def test_a_gemma_worker_takes_any_backend_each_has_windows(device, asked, chosen):
    from types import SimpleNamespace

    from pagedserve.services.gpu_worker.attention import BACKENDS, get_backend
    from pagedserve.services.gpu_worker.worker import Worker

    worker = SimpleNamespace(model_config=ModelConfig.from_hf_config(GEMMA3_1B), device=torch.device(device),
                             config=SimpleNamespace(attention_backend=asked))
    assert Worker._backend_name(worker) == chosen
    worker.model_config = ModelConfig.from_hf_config({**BASE, "model_type": "qwen3"})
    assert Worker._backend_name(worker) == chosen  # as for every family
    for name in BACKENDS:  # each one's test checks its windows
        assert {"window", "softcap"} <= set(inspect.signature(get_backend(name).attend).parameters)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_in_bfloat16_picks_float32s_tokens_or_a_tie(tmp_path, name):
    """bf16 runs the same plain ops and windowed attention: each prefill position's greedy token is
    float32's, or one float32 rates within a bf16 tie."""
    from tests.gpu_worker.test_model import assert_bf16_choice

    save_checkpoint(name, tmp_path)
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(str(tmp_path), dtype=dtype)
        caches = KVPool(model.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype).kv_caches
        logits[dtype] = model.compute_logits(run_step(model, caches, [(prompt, 0, BLOCK_TABLE)]))
    assert logits[torch.bfloat16].dtype == torch.float32 and torch.isfinite(logits[torch.bfloat16]).all()
    for exact, token in zip(logits[torch.float32], logits[torch.bfloat16].argmax(-1).tolist(), strict=True):
        assert_bf16_choice(exact, token)
