"""The physical KV block pool, allocated once: per layer [2, num_blocks, block_size, Hkv, D]
(int8: D + S, each row's group scales after it, kv_quant.py). A block id means the same rows in every
layer; ownership is the kvstore's business."""

from __future__ import annotations

import torch

from pagedserve.services.gpu_worker.attention.kv_quant import row_width
from pagedserve.services.gpu_worker.host_memory import huge_pages_zeros
from pagedserve.shared.config import EngineConfig, parse_size
from pagedserve.shared.model_config import ModelConfig


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * row_width(model.head_dim, dtype) * elem


def num_blocks_for(config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    """How many blocks fit the budget: bytes on CPU, a fraction of free memory on a GPU."""
    if config.num_blocks is not None:
        return config.num_blocks
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_utilization)
    else:
        budget = parse_size(config.kv_cache_memory)
    num_blocks = budget // bytes_per_block(model, config.block_size, dtype)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory={config.kv_cache_memory!r} holds no block of this model")
    return num_blocks


class KVPool:
    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (2, num_blocks, block_size, model.num_kv_heads, row_width(model.head_dim, dtype))
        # zeros, not empty: a never-written slot must not hold NaN that a masked lane reads
        if torch.device(device).type == "cpu":
            self.kv_caches = [huge_pages_zeros(shape, dtype) for _ in range(model.num_layers)]
        else:
            self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)
