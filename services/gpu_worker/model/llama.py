"""The llama-shaped decoder over one flat ragged sequence of T tokens (AttentionMetadata maps them
to requests) with a paged KV cache; fused qkv/gate_up projections, uninitialized until loaded.
The families (families.py) are switches in its config: q/k/v and o biases, per-head q/k norms."""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from pagedserve.services.gpu_worker.attention.metadata import AttentionBackend, AttentionMetadata
from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.model import gguf_blocks
from pagedserve.services.gpu_worker.model.greedy_head import GreedyHead
from pagedserve.services.gpu_worker.model.linear import PackedLinear
from pagedserve.services.gpu_worker.model.rotary_embedding import RotaryEmbedding
from pagedserve.services.gpu_worker.model.screened_head import ScreenedHead
from pagedserve.shared.model_config import ModelConfig
from pagedserve.shared.model_families import FAMILIES

FUSED_FAMILIES = {name for name, f in FAMILIES.items() if f.fused_projections}


def _param(*shape: int, dtype: torch.dtype, device) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device=None, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset  # Gemma: scales by (1 + weight)
        self.weight = _param(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # plain-ops path: statistics in float32, weight applied after casting back (as HF's Llama),
        # or (offset + weight) applied in float32 before it (as HF's Gemma)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device=None, index: int = 0):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.qkv_sizes = [self.q_size, self.kv_size, self.kv_size]
        self.scale = (c.query_pre_attn_scalar or c.head_dim) ** -0.5
        self.window, self.softcap = c.window(index), c.attn_softcap  # None, None: plain causal attention
        self.gelu = c.hidden_act == "gelu_pytorch_tanh"
        norm = functools.partial(RMSNorm, eps=c.rms_norm_eps, dtype=dtype, device=device, offset=c.norm_offset)
        self.input_layernorm = norm(c.hidden_size)
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, c.hidden_size, dtype=dtype, device=device)
        self.o_proj = _param(c.hidden_size, self.q_size, dtype=dtype, device=device)
        self.post_attention_layernorm = norm(c.hidden_size)  # Gemma: on attention's output
        self.pre_feedforward_layernorm = norm(c.hidden_size) if c.sandwich_norms else None
        self.post_feedforward_layernorm = norm(c.hidden_size) if c.sandwich_norms else None
        self.gate_up_proj = _param(2 * c.intermediate_size, c.hidden_size, dtype=dtype, device=device)
        self.down_proj = _param(c.hidden_size, c.intermediate_size, dtype=dtype, device=device)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, dtype=dtype, device=device) if c.qkv_bias else None
        self.o_bias = _param(c.hidden_size, dtype=dtype, device=device) if c.o_bias else None
        self.q_norm = norm(c.head_dim) if c.qk_norm else None
        self.k_norm = norm(c.head_dim) if c.qk_norm else None
        self.prepare(None, pack=False)

    def prepare(self, fused, pack: bool = True, blocks: dict | None = None) -> None:
        """(Re)build the projections; fused None: plain torch ops. blocks: GGUF blocks by projection."""
        blocks = blocks or {}
        self.qkv, self.o, self.gate_up, self.down = (
            PackedLinear(w, pack, blocks.get(key)) for key, w in
            (("qkv", self.qkv_proj), ("o", self.o_proj), ("gate_up", self.gate_up_proj), ("down", self.down_proj)))
        self.fused = fused

    def forward(self, hidden, positions, rotary, kv_cache, meta, backend) -> torch.Tensor:
        attn_out = self._attention(self.input_layernorm(hidden), positions, rotary, kv_cache, meta, backend)
        if self.pre_feedforward_layernorm is not None:  # Gemma's sandwich
            h = hidden + self.post_attention_layernorm(attn_out)
            return h + self.post_feedforward_layernorm(self._mlp(self.pre_feedforward_layernorm(h)))
        h = hidden + attn_out
        return h + self._mlp(self.post_attention_layernorm(h))

    def _mlp(self, normed: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(normed).chunk(2, dim=-1)
        return self.down((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)

    def forward_fused(self, x, residual, positions, rotary, kv_cache, meta, backend):
        """Returns (mlp_out, residual) whose sum is the output: the add happens in the next add_rms_norm."""
        normed = torch.empty_like(x)
        if residual is None:
            residual = x
            self.fused.rms_norm(normed, x, self.input_layernorm.weight, self.input_layernorm.eps)
        else:  # x <- x + residual, the new residual; normed = its norm
            self.fused.add_rms_norm(normed, x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
            residual = x
        h = self._attention(normed, positions, rotary, kv_cache, meta, backend)  # becomes the next residual
        normed = torch.empty_like(h)
        self.fused.add_rms_norm(normed, h, residual, self.post_attention_layernorm.weight,
                                self.post_attention_layernorm.eps)
        gate_up = self.gate_up(normed)  # [T, 2 I]
        act = torch.empty(h.shape[0], gate_up.shape[1] // 2, dtype=h.dtype)
        self.fused.silu_and_mul(act, gate_up)
        return self.down(act), h

    def _attention(self, normed, positions, rotary, kv_cache, meta, backend) -> torch.Tensor:
        num_tokens = normed.shape[0]
        qkv = self.qkv(normed)  # [T, (H + 2 Hkv) * D]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv.split_with_sizes(self.qkv_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # per head, before rope (new contiguous tensors)
            q, k = self.q_norm(q), self.k_norm(k)
        if (self.fused is not None and rotary.full and kv_cache.is_contiguous()
                and kv_cache.dtype in (q.dtype, torch.int8)):
            # rotary on q and k and the K/V writes into the pool, one pass per token (cpu_fused.cpp);
            # an int8 pool's rows are quantized in that pass
            self.fused.rope_write_kv(q, k, v, positions, rotary.cos, rotary.sin, kv_cache, meta.slot_mapping)
        else:
            q, k = rotary(positions, q, k, self.fused)
            backend.write_kv(k, v, kv_cache, meta)
        attn = backend.attend(q, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap)  # [T, H, D]
        out = self.o(attn.reshape(num_tokens, self.q_size))
        return out if self.o_bias is None else out + self.o_bias


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(config, device)
        # Gemma 3's sliding layers turn at their own base, unscaled
        self.local_rotary = self.rotary if config.rope_local_theta is None else RotaryEmbedding(
            dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None), device)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(config, dtype, device, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, config.norm_offset)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        )
        self.prepare(optimized=False)

    def prepare(self, optimized: bool = True) -> None:
        """Pack projections, take fused kernels; call again after changing parameters (packs are copies)."""
        on_cpu = self.embed_tokens.device.type == "cpu"
        # the fused kernels have neither Gemma's (1 + w) norms nor its sandwich: plain ops there
        fusable = on_cpu and self.dtype in (torch.bfloat16, torch.float32) and not self.config.sandwich_norms
        fused = cpu_extensions.load("fused") if optimized and fusable else None
        head_name = "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
        gguf = getattr(self, "gguf_blocks", {}) if optimized and on_cpu else {}
        head_weight = self.embed_tokens if self.lm_head is None else self.lm_head
        self.head = PackedLinear(head_weight, optimized, gguf.get(head_name))
        self.screened_head = ScreenedHead.build(head_weight) if optimized else None  # float32 greedy
        self.greedy_head = GreedyHead.build(self.head) if optimized else None  # float32 greedy, no logits
        self.fused = fused  # None: every layer on plain torch ops (forward); else forward_fused
        for i, layer in enumerate(self.layers):
            layer.prepare(fused, optimized, self._layer_blocks(gguf, i))

    def attach_gguf_blocks(self, blocks: dict[str, tuple[torch.Tensor, ...]]) -> None:
        self.gguf_blocks = blocks

    @staticmethod
    def _layer_blocks(blocks: dict, i: int) -> dict[str, tuple[torch.Tensor, ...]]:
        p = f"model.layers.{i}."
        names = {"qkv": [p + f"self_attn.{x}_proj.weight" for x in "qkv"], "o": [p + "self_attn.o_proj.weight"],
                 "gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                 "down": [p + "mlp.down_proj.weight"]}
        return {key: gguf_blocks.concat([blocks[n] for n in parts])
                for key, parts in names.items()
                if all(n in blocks for n in parts) and len({len(blocks[n]) for n in parts}) == 1}

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """input_ids, positions int64 [T] -> final-normed hidden states [T, hidden_size]."""
        positions = positions.long()
        hidden = F.embedding(input_ids, self.embed_tokens)
        if self.config.embed_scale != 1.0:  # in the model's dtype, as transformers scales it
            hidden = hidden * torch.tensor(self.config.embed_scale, dtype=hidden.dtype)
        fused = self.fused
        if fused is None:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                rotary = self.rotary if layer.window is None else self.local_rotary
                hidden = layer(hidden, positions, rotary, kv_cache, meta, backend)
            return self.norm(hidden)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer.forward_fused(hidden, residual, positions, self.rotary, kv_cache, meta, backend)
        out = torch.empty_like(hidden)
        fused.add_rms_norm(out, hidden, residual, self.norm.weight, self.norm.eps)
        return out

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, as_float: bool = True) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab], float32 if as_float else the model's dtype."""
        logits = self.head(hidden)
        cap = self.config.final_softcap  # monotonic: a greedy token is the uncapped argmax
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if as_float else logits

    @torch.no_grad()
    def load_state_dict_canonical(self, state: dict[str, torch.Tensor]) -> None:
        """Copy an HF-named state dict (exactly the expected names) into the fused parameters."""
        names = set(state)
        if self.lm_head is None:
            names.discard("lm_head.weight")
        expected = set(canonical_names(self.config))
        if names != expected:
            raise ValueError(
                f"state dict mismatch: missing {sorted(expected - names)[:8]}, "
                f"unexpected {sorted(names - expected)[:8]}"
            )
        self.embed_tokens.copy_(state["model.embed_tokens.weight"])
        self.norm.weight.copy_(state["model.norm.weight"])
        if self.lm_head is not None:
            self.lm_head.copy_(state["lm_head.weight"])
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            if self.config.architecture in FUSED_FAMILIES:  # the checkpoint's own [q; k; v] and [gate; up]
                layer.qkv_proj.copy_(state[attn + "qkv_proj.weight"])
                layer.gate_up_proj.copy_(state[mlp + "gate_up_proj.weight"])
            else:
                layer.qkv_proj.copy_(torch.cat([state[attn + f"{x}_proj.weight"] for x in "qkv"]))
                layer.gate_up_proj.copy_(torch.cat([state[mlp + f"{x}_proj.weight"] for x in ("gate", "up")]))
            layer.o_proj.copy_(state[attn + "o_proj.weight"])
            layer.down_proj.copy_(state[mlp + "down_proj.weight"])
            layer.input_layernorm.weight.copy_(state[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(state[p + "post_attention_layernorm.weight"])
            if layer.pre_feedforward_layernorm is not None:
                layer.pre_feedforward_layernorm.weight.copy_(state[p + "pre_feedforward_layernorm.weight"])
                layer.post_feedforward_layernorm.weight.copy_(state[p + "post_feedforward_layernorm.weight"])
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(torch.cat([state[attn + f"{x}_proj.bias"] for x in "qkv"]))
            if layer.o_bias is not None:
                layer.o_bias.copy_(state[attn + "o_proj.bias"])
            if layer.q_norm is not None:
                layer.q_norm.weight.copy_(state[attn + "q_norm.weight"])
                layer.k_norm.weight.copy_(state[attn + "k_norm.weight"])
        self.prepare()


def canonical_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    if config.architecture in FUSED_FAMILIES:
        per_layer = ["self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                     "mlp.down_proj.weight"]
    else:
        per_layer = [f"self_attn.{x}_proj.weight" for x in "qkvo"]
        per_layer += [f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    per_layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if config.sandwich_norms:
        per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    if config.qkv_bias:
        per_layer += [f"self_attn.{x}_proj.bias" for x in "qkv"]
    if config.o_bias:
        per_layer.append("self_attn.o_proj.bias")
    if config.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for i in range(config.num_layers):
        names += [f"model.layers.{i}.{suffix}" for suffix in per_layer]
    return names


def build_model(path_or_name: str, dtype: torch.dtype = torch.float32, device=None) -> LlamaForCausalLM:
    """Load weights (GGUF or HF dir, by name or path) into a ready, eval-mode model."""
    from pagedserve.services.gpu_worker.model.weights import load_weights

    config, state = load_weights(path_or_name)
    model = LlamaForCausalLM(config, dtype=dtype, device=device)
    if dtype in (torch.bfloat16, torch.float32) and model.embed_tokens.device.type == "cpu":
        model.attach_gguf_blocks({**gguf_blocks.load_q4_1(path_or_name, config),
                                  **gguf_blocks.load_q8_0(path_or_name, config)})
    model.load_state_dict_canonical(state)
    return model.eval()
