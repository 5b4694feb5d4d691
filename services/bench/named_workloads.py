"""The named benchmark workloads: seeded, so a name gives the same token ids everywhere; ids in
[100, VOCAB - 100) avoid special tokens (run greedily with ignore_eos)."""

from __future__ import annotations

import random
from collections.abc import Callable

VOCAB = 49152  # SmolLM2 tokenizer


def random_mix(n: int, seed: int, plo: int, phi: int, olo: int, ohi: int) -> list[dict]:
    """n requests, prompt lengths in [plo, phi], outputs in [olo, ohi]."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(plo, phi)
        o = rng.randint(olo, ohi)
        out.append({"prompt_token_ids": [rng.randrange(100, VOCAB - 100) for _ in range(p)], "max_tokens": o})
    return out


def shared_prefix(n: int, seed: int, prefix: int, suffix: int, o: int) -> list[dict]:
    """n requests sharing one prefix of `prefix` tokens, `suffix` distinct tokens each."""
    rng = random.Random(seed)
    pre = [rng.randrange(100, VOCAB - 100) for _ in range(prefix)]
    return [{"prompt_token_ids": pre + [rng.randrange(100, VOCAB - 100) for _ in range(suffix)], "max_tokens": o}
            for _ in range(n)]


def multi_prefix(num_prefixes: int, per_prefix: int, seed: int, prefix: int, suffix: int, o: int) -> list[dict]:
    """num_prefixes "system prompts", per_prefix requests each, seeded shuffle (round robin cannot
    split it evenly by chance): what routing by cached prefix buys over round robin."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, VOCAB - 100) for _ in range(prefix)] for _ in range(num_prefixes)]
    order = [p for p in range(num_prefixes) for _ in range(per_prefix)]
    rng.shuffle(order)
    return [{"prompt_token_ids": prefixes[p] + [rng.randrange(100, VOCAB - 100) for _ in range(suffix)],
             "max_tokens": o} for p in order]


WORKLOADS: dict[str, Callable[[], list[dict]]] = {
    "random-64": lambda: random_mix(64, 0, 64, 512, 32, 256),
    # 64 x 256 prompt tokens, 128 out: `vllm bench serve`'s random prompts at --random-input-len 256
    "serve-64": lambda: random_mix(64, 3, 256, 256, 128, 128),
    "shared-prefix-32": lambda: shared_prefix(32, 1, 512, 32, 64),
    "decode-heavy-128": lambda: random_mix(128, 3, 16, 64, 256, 256),
    # 8 system prompts of 512 tokens, 8 requests each (shuffled), 32 distinct tokens, 32 output tokens
    "multi-prefix-64": lambda: multi_prefix(8, 8, 4, 512, 32, 32),
    # 256 short chats at once (prompts 16-64 tokens, 128 output tokens each): the control plane
    "chat-256": lambda: random_mix(256, 7, 16, 64, 128, 128),
    # prompts 32-512, outputs 16-256: the engine on a mix unlike random-64's
    "mix-96": lambda: random_mix(96, 21, 32, 512, 16, 256),
    # 8 prompts of 3,936-4,000 tokens, 64 output tokens each: decodes over ~4,000-token contexts
    "long-context-8": lambda: random_mix(8, 29, 3936, 4000, 64, 64),
    # 16 chats whose answers quote their input (code edits, rewrites, summaries), up to 192 tokens, to EOS:
    # where prompt lookup speculation has drafts to find (grounded_workload.py; SmolLM2's tokenizer)
    "grounded-edits-16": lambda: _grounded(),
}


def _grounded() -> list[dict]:
    from pagedserve.services.bench.grounded_workload import grounded_edits

    return grounded_edits()
