"""Baseline: HF transformers `generate` with static batches on the same requests.

Fixed batches in arrival order, left-padded, run to the longest max_tokens; only each
request's own max_tokens count, so figures compare with the engine's.
"""

from __future__ import annotations

import os
import time

from pagedserve.services.bench.report import throughput_fields
from pagedserve.services.bench.workloads import BenchRequest


def run_hf_baseline(requests: list[BenchRequest], model: str, dtype: str, batch_size: int = 16,
                    progress=None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from pagedserve.shared.model_source import resolve_model

    path = resolve_model(model)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    if os.path.isdir(path):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype=torch_dtype)
    hf.eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    started = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        new = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                        pad_token_id=pad)
        if progress is not None:
            progress(len(batch))
    wall = time.perf_counter() - started
    num_output = sum(r.max_tokens for r in requests)
    num_prompt = sum(len(r.prompt_token_ids) for r in requests)
    return {"system": f"hf-transformers-static-batch{batch_size}",
            **throughput_fields(wall, len(requests), num_output, num_prompt)}
