"""Engine configuration; bad config fails at start with the field named (ConfigError)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pagedserve.shared.config_error import ConfigError
from pagedserve.shared.scheduler_config import DEFAULT_POLICY, StepLimits
from pagedserve.shared.speculative_config import parse_speculative_config

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
               "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype; int8: groups of 32 with their scales (kv_quant.py)


# the offload tier (kvstore --kv-offload-memory): as big as one worker's default pool, so a
# pool's worth of evicted prefixes stays loadable; Redis holds it, in host memory
DEFAULT_KV_OFFLOAD_MEMORY = "2GiB"


def kv_offload_bytes(text: str | int) -> int:
    """The offload tier's budget in bytes (0: off); ConfigError naming kv_offload_memory."""
    try:
        return parse_size(text)
    except ConfigError as e:
        raise ConfigError(f"invalid config field 'kv_offload_memory'={text!r}: {e}") from None


def parse_size(text: str | int) -> int:
    """'2GiB' -> 2147483648; a bare number is bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"not a memory size: {text!r} (use e.g. 512MiB, 2GiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


@dataclass
class EngineConfig(StepLimits):  # its step limits: scheduler_config.py
    model: str = "smollm2"
    dtype: str = "auto"  # auto: bfloat16 where the CPU/GPU has it, else float32
    device: str = "cpu"
    attention_backend: str = "auto"  # auto: torch on CPU, triton on CUDA
    block_size: int = 16
    kv_cache_memory: str | int = "2GiB"  # CPU budget for the pool
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES: the pool's storage
    gpu_memory_utilization: float = 0.8  # fraction of free device memory on a GPU
    num_blocks: int | None = None  # overrides the memory budget (tests)
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True  # as vLLM: on unless turned off for comparison
    policy: str = DEFAULT_POLICY  # loaded when the engine starts
    policy_options: dict = field(default_factory=dict)
    seed: int = 0
    # vLLM's --speculative-config as a dict or JSON text (shared/speculative_config.py); None: off
    speculative_config: dict | str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, name: str, why: str) -> None:
            if not cond:
                raise ConfigError(f"invalid config field {name!r}={getattr(self, name)!r}: {why}")

        need(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
             "one of auto, float32, bfloat16, float16")
        need(self.attention_backend in ("auto", "torch", "triton", "reference"), "attention_backend",
             "one of auto, torch, triton, reference")
        need(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", "a power of two <= 128")
        parse_size(self.kv_cache_memory)
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"one of {', '.join(KV_CACHE_DTYPES)}")
        need(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "in (0, 1]")
        need(self.num_blocks is None or self.num_blocks >= 1, "num_blocks", "at least 1")
        need(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "at least 2")
        need(isinstance(self.policy, str) and bool(self.policy), "policy", "an installed policy's name")
        need(isinstance(self.policy_options, dict), "policy_options", "a dict of the policy's options")
        parse_speculative_config(self.speculative_config)
