"""The GGUF's quantized blocks (pagedserve.services.gpu_worker.model.gguf_blocks): SmolLM2's dequantize bit for
bit to the loaded float32 weights, and the packed layouts the few-row kernels read."""

from __future__ import annotations

import pytest
import torch

from pagedserve.services.gpu_worker.model import gguf_blocks
from pagedserve.services.gpu_worker.model.weights import load_weights
from tests.gpu_worker.gguf_factories import q4_1_blocks, q8_0_blocks


@pytest.fixture(scope="module")
def smollm2():
    config, state = load_weights("smollm2")
    return config, state, gguf_blocks.load_q4_1("smollm2", config), gguf_blocks.load_q8_0("smollm2", config)


def test_smollm2_q4_1_blocks_dequantize_to_the_loaded_weights(smollm2):
    config, state, q4_1, _ = smollm2
    assert len(q4_1) == 7 * config.num_layers  # every projection of SmolLM2's GGUF is Q4_1
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight"):
        q, d, m = q4_1[name]
        assert q.dtype == torch.uint8 and int(q.max()) <= 15 and d.shape == (q.shape[0], q.shape[1] // 32)
        assert torch.equal(gguf_blocks.dequantize(q, d, m), state[name])  # bit for bit, Q/K rows unpermuted


def test_smollm2_q8_0_embedding_dequantizes_to_the_loaded_weight(smollm2):
    _, state, _, q8_0 = smollm2
    assert list(q8_0) == ["model.embed_tokens.weight"]  # the tied LM head
    q, d = q8_0["model.embed_tokens.weight"]
    assert q.dtype == torch.int8 and q.shape == (49152, 576) and d.shape == (49152, 18)
    assert torch.equal(gguf_blocks.dequantize(q, d), state["model.embed_tokens.weight"])


def test_pack_q4_1_layout():
    q, d, m = q4_1_blocks(32, 64)
    nibbles, dm = gguf_blocks.pack_q4_1(q, d, m)
    assert nibbles.shape == (2, 32, 16) and dm.shape == (2, 2, 2, 16) and dm.dtype == torch.int16
    # block 1 (outputs 16..31), k pair 3 (k = 6, 7), output 16 + 5: low nibble k=6, high k=7
    assert int(nibbles[1, 3, 5]) == int(q[21, 6]) | int(q[21, 7]) << 4
    # block 0, group 1 (k 32..63): d then m of outputs 0..15, as fp16
    assert dm[0, 1, 0].view(torch.float16).float().tolist() == d[:16, 1].tolist()
    assert dm[0, 1, 1].view(torch.float16).float().tolist() == m[:16, 1].tolist()


def test_pack_q8_0_layout():
    q, d = q8_0_blocks(32, 64)
    packed_q, packed_d = gguf_blocks.pack_q8_0(q, d)
    assert packed_q.shape == (2, 64, 16) and packed_d.shape == (2, 2, 16) and packed_d.dtype == torch.int16
    assert packed_q[1, 37].tolist() == q[16:32, 37].tolist()  # block 1, k 37: outputs 16..31
    assert packed_d[1, 1].view(torch.float16).float().tolist() == d[16:32, 1].tolist()


def test_packing_refuses_shapes_the_kernels_cannot_tile():
    with pytest.raises(ValueError, match="N % 16"):
        gguf_blocks.pack_q4_1(*q4_1_blocks(24, 64))
    with pytest.raises(ValueError, match="K % 32"):
        gguf_blocks.pack_q8_0(torch.zeros(16, 48, dtype=torch.int8), torch.zeros(16, 1))


def test_the_gguf_is_parsed_once_per_file_version(smollm2):
    from pagedserve.shared.model_reader import open_gguf, resolve_model

    path = resolve_model("smollm2")
    assert open_gguf(path) is open_gguf(path)  # the state dict and both block kinds share it
