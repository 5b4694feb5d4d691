"""The in-process engine: the services' three pure objects, messages passed as objects.
One step: schedule() -> block_manager.step() -> on_alloc() -> worker.execute() -> on_result().
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from pagedserve.services.gpu_worker.worker import Worker
from pagedserve.services.kvstore.block_manager import BlockManager
from pagedserve.services.scheduler.policies.registry import configured_policy
from pagedserve.services.scheduler.request import Request
from pagedserve.services.scheduler.scheduler import Scheduler
from pagedserve.shared.block_hash import BlockHashes, root_hash
from pagedserve.shared.config import EngineConfig
from pagedserve.shared.messages import RequestDelta, SamplingParams
from pagedserve.shared.parallel_sampling import child_request_ids
from pagedserve.shared.prompt_check import check_context, check_prompt
from pagedserve.shared.speculative_config import parse_speculative_config


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    text: str | None = None
    choices: list[GenerationOutput] = field(default_factory=list)  # n > 1: the n sequences, by index


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        self.config = config or EngineConfig(**overrides)
        policy = configured_policy(self.config.policy, self.config.policy_options)  # before the weights load
        self.worker = Worker(self.config)
        model_config = self.worker.model_config
        self.max_model_len = model_config.context_length(self.config.max_model_len or None)
        self.eos_token_ids = list(model_config.eos_token_ids)
        self.block_manager = BlockManager(self.worker.num_blocks, self.config.block_size,
                                          enable_prefix_caching=self.config.enable_prefix_caching,
                                          hash_keys=(self.config.model,))
        self.scheduler = Scheduler(policy, max_num_seqs=self.config.max_num_seqs,
                                   max_num_batched_tokens=self.config.max_num_batched_tokens,
                                   long_prefill_token_threshold=self.config.long_prefill_token_threshold,
                                   max_model_len=self.max_model_len,
                                   speculative_config=parse_speculative_config(self.config.speculative_config),
                                   num_scheduler_steps=self.config.num_scheduler_steps)
        self._ids = itertools.count()
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from pagedserve.shared.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.config.model)
        return self._tokenizer

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        check_prompt(prompt_token_ids, self.worker.model_config.vocab_size)
        check_context(len(prompt_token_ids), sampling.max_tokens, self.max_model_len)

    def add_request(self, prompt: list[int] | str, sampling: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        sampling = sampling or SamplingParams()
        prompt_token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(prompt_token_ids, sampling)
        request_id = request_id or f"req-{next(self._ids)}"
        request = Request(request_id, prompt_token_ids, sampling, self.eos_token_ids, arrival_time=time.monotonic())
        if self.config.enable_prefix_caching:  # hashed once here, as the block manager's hash_keys chain them
            root = root_hash((self.config.model, request.cache_salt))
            request.block_hashes = BlockHashes(root, self.config.block_size)
        self.scheduler.add_request(request)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        # counts ids whose blocks the next step frees: a loop on it ends with the pool whole
        return self.scheduler.has_requests()

    def step(self) -> list[RequestDelta]:
        alloc = self.scheduler.schedule()
        reply = self.block_manager.step(alloc)
        plan = self.scheduler.on_alloc(reply)
        result = self.worker.execute(plan)
        return self.scheduler.on_result(result)

    def generate(self, prompts: list[list[int] | str], sampling: SamplingParams | list[SamplingParams] | None = None,
                 decode: bool = False) -> list[GenerationOutput]:
        """Run every prompt to completion; outputs in the prompts' order."""
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
        outputs: dict[str, GenerationOutput] = {}
        order = []
        for prompt, p in zip(prompts, params, strict=False):
            request_id = self.add_request(prompt, p)
            order.append(request_id)
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            outputs[request_id] = GenerationOutput(request_id, ids)
            if p.n > 1:
                for child_id in child_request_ids(request_id, p.n):
                    outputs[child_id] = GenerationOutput(child_id, ids)
                    outputs[request_id].choices.append(outputs[child_id])
        while self.has_unfinished_requests():
            self.collect(self.step(), outputs)
        for out in outputs.values():
            if decode:
                out.text = self.tokenizer.decode(out.token_ids)
            if out.choices:  # the parent itself never samples: it stands for choice 0 too
                first = out.choices[0]
                out.token_ids, out.finish_reason, out.text = first.token_ids, first.finish_reason, first.text
                out.num_cached_tokens = max(c.num_cached_tokens for c in out.choices)
        return [outputs[r] for r in order]

    @staticmethod
    def collect(deltas: list[RequestDelta], outputs: dict[str, GenerationOutput]) -> None:
        for delta in deltas:
            out = outputs.get(delta.request_id)
            if out is None:
                continue
            out.token_ids.extend(delta.new_token_ids)
            out.num_cached_tokens = max(out.num_cached_tokens, delta.num_cached_tokens)
            if delta.finish_reason is not None:
                out.finish_reason = delta.finish_reason
