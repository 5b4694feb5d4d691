"""The worker: one StepPlan in, one StepResult out; it decides nothing and keeps each request's
tokens (sampled ones appended here), block table and sampling state."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from pagedserve.services.gpu_worker import weight_cache
from pagedserve.services.gpu_worker.attention import get_backend
from pagedserve.services.gpu_worker.attention.block_copy import copy_blocks
from pagedserve.services.gpu_worker.attention.kv_quant import cache_dtype
from pagedserve.services.gpu_worker.attention.metadata import AttentionMetadata
from pagedserve.services.gpu_worker.device import resolve_device, resolve_dtype
from pagedserve.services.gpu_worker.host_memory import keep_freed_memory
from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.kv_pool import KVPool, num_blocks_for
from pagedserve.services.gpu_worker.model.linear import rows_alone
from pagedserve.services.gpu_worker.model.llama import build_model
from pagedserve.services.gpu_worker.model.screened_head import MIN_ROWS as SCREEN_MIN_ROWS
from pagedserve.services.gpu_worker.pool_prefault import PoolPrefault
from pagedserve.services.gpu_worker.sampling.grammar import Grammars, SequenceGrammar
from pagedserve.services.gpu_worker.sampling.prompt_logprobs import PromptSpan, prompt_logprobs, prompt_span
from pagedserve.services.gpu_worker.sampling.sampler import greedy_tokens, plain_greedy, sample
from pagedserve.services.gpu_worker.sampling.verify import accept_drafts, draft_histories
from pagedserve.services.gpu_worker.startup import StartupPhases, waited_for
from pagedserve.shared.config import EngineConfig
from pagedserve.shared.messages import SampledToken, SamplingParams, StepPlan, StepResult

log = logging.getLogger("pagedserve.worker")
KERNELS = "loading the CPU kernels (built once per machine: minutes the first time, `pagedserve build-kernels` " \
          "does it ahead)"
IDLE_COMPILE_WAIT_S = 0.02  # a step with nothing to run waits this long for a prefetched grammar


def _load_kernels(phases: StartupPhases) -> None:
    with phases.phase("kernels", KERNELS):
        for name in cpu_extensions.SOURCES:
            lock = cpu_extensions.build_dir(name) / "pagedserve.flock"  # the one load() takes
            if waited_for(lock, phases, "kernels_wait", f"waiting for another process building the CPU kernel "
                                                        f"{name!r} ({lock})"):
                phases.begin(KERNELS)
            cpu_extensions.load(name)


@dataclass
class _RequestState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    num_prompt_tokens: int  # token_ids[:num_prompt_tokens] is the prompt (penalties tell them apart)
    num_scheduled_tokens: int = 0
    grammar: SequenceGrammar | None = None  # structured output: its matcher
    draft_token_ids: list[int] = field(default_factory=list)  # this step's guesses, after its known tokens


class Worker:
    def __init__(self, config: EngineConfig, phases: StartupPhases | None = None):
        """phases: where the start's steps are timed and logged (`pagedserve worker` passes its own)."""
        phases = phases or StartupPhases()
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            keep_freed_memory()
            if cpu_extensions.enabled():
                _load_kernels(phases)
        self.model = weight_cache.load_model(config.model, self.dtype, self.device, build_model, phases)
        self.model_config = self.model.config
        self.backend = get_backend(self._backend_name())
        self.block_size = config.block_size
        self.kv_dtype = cache_dtype(config.kv_cache_dtype, self.dtype)
        num_blocks = num_blocks_for(config, self.model_config, self.kv_dtype, self.device)
        with phases.phase("kv_pool", f"allocating the KV pool ({num_blocks} blocks)"):
            self.pool = KVPool(self.model_config, num_blocks, config.block_size, self.kv_dtype, self.device)
        self.prefault: PoolPrefault | None = None  # start_prefault()
        self.requests: dict[str, _RequestState] = {}
        self.grammars = Grammars(config.model, self.model_config.vocab_size, list(self.model_config.eos_token_ids),
                                 overlap=self.device.type != "cpu")
        log.info("worker ready: model=%s dtype=%s backend=%s num_blocks=%d (%.0f MiB); %s",
                 config.model, self.dtype, self.backend.name, num_blocks, self.pool.num_bytes / 2**20,
                 phases.summary())

    def start_prefault(self) -> None:
        """A CPU pool's pages faulted in from a background thread while no step runs (pool_prefault.py)."""
        if self.device.type == "cpu" and self.prefault is None:
            self.prefault = PoolPrefault(self.pool, self.pool.kv_caches)
            if self.prefault.start() is None:
                self.prefault = None

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def _backend_name(self) -> str:
        """The configured backend; auto: triton on CUDA, torch elsewhere (each has Gemma's windows and caps)."""
        name = self.config.attention_backend
        if name == "auto":
            return "triton" if self.device.type == "cuda" else "torch"
        return name

    def _apply_plan(self, plan: StepPlan) -> list[str]:
        """Update per-request state from the plan's diffs; return the scheduled ids in order."""
        if plan.reset:
            self.requests.clear()
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        if plan.block_copies:
            copy_blocks(self.pool.kv_caches, plan.block_copies)
        scheduled: list[str] = []
        for new in plan.new_requests:
            self.requests[new.request_id] = _RequestState(
                token_ids=list(new.token_ids), block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens, sampling=new.sampling,
                num_prompt_tokens=len(new.token_ids) - new.num_output_tokens,
                num_scheduled_tokens=new.num_scheduled_tokens)
            if new.sampling.guided is not None:  # new, resumed or migrated: replay its output so far
                self.requests[new.request_id].grammar = self.grammars.sequence(
                    new.sampling.guided, new.token_ids[len(new.token_ids) - new.num_output_tokens:])
            scheduled.append(new.request_id)
        for cached in plan.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            state.num_scheduled_tokens = cached.num_scheduled_tokens
            state.draft_token_ids = list(cached.draft_token_ids)
            scheduled.append(cached.request_id)
        return scheduled

    def _compiled_grammars(self, wait_s: float = 0.0) -> list[str]:
        return self.grammars.take_compiled(wait_s) if self.grammars.watched else []

    def _greedy(self, hidden: torch.Tensor) -> list[int]:
        screened = self.model.screened_head
        tokens = screened.tokens(hidden) if screened is not None and len(hidden) >= SCREEN_MIN_ROWS else None
        if tokens is None and self.model.greedy_head is not None:
            tokens = self.model.greedy_head.tokens(hidden)
        return tokens if tokens is not None else greedy_tokens(self.model.compute_logits(hidden, as_float=False))

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        if plan.compile_grammars:
            self.grammars.prefetch(plan.compile_grammars)
        scheduled = [r for r in self._apply_plan(plan) if self.requests[r].num_scheduled_tokens > 0]
        if not scheduled:
            return StepResult(step_id=plan.step_id, compiled_grammars=self._compiled_grammars(IDLE_COMPILE_WAIT_S))
        if self.prefault is None:
            return self._run_steps(plan, scheduled)
        self.prefault.step_started()
        try:
            return self._run_steps(plan, scheduled)
        finally:
            self.prefault.step_ended()

    def _run_steps(self, plan: StepPlan, scheduled: list[str]) -> StepResult:
        """The plan's step, then its multi-step requests' further decode steps (CachedRequestData.num_steps)."""
        result = self._run_step(plan, scheduled)
        steps_left = {c.request_id: c.num_steps - 1 for c in plan.cached_requests if c.num_steps > 1}
        while steps_left:
            decoding = [r for r in scheduled if steps_left.get(r, 0) > 0 and not self._stopped(self.requests[r])]
            if not decoding:
                break
            for request_id in decoding:
                self.requests[request_id].num_scheduled_tokens = 1
                steps_left[request_id] -= 1
            more = self._run_step(plan, decoding)
            result.sampled += more.sampled
            result.compiled_grammars += more.compiled_grammars
            result.step_seconds += more.step_seconds
        return result

    def _stopped(self, state: _RequestState) -> bool:
        """Its last token ends it (an EOS unless ignored, or a stop token): the scheduler stops it there too."""
        last, sampling = state.token_ids[-1], state.sampling
        return (not sampling.ignore_eos and last in self.model_config.eos_token_ids) or last in sampling.stop_token_ids

    def _run_step(self, plan: StepPlan, scheduled: list[str]) -> StepResult:
        started = time.perf_counter()
        states = [self.requests[r] for r in scheduled]
        input_ids: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        sample_rows: list[int] = []  # flat index of the last new token of each sampling request, and of its drafts
        sample_ids: list[str] = []  # the request of each sampling row (one with d drafts has d + 1 rows)
        spans: list[PromptSpan] = []  # prefill chunks whose requests want the prompt's logprobs
        for request_id, state in zip(scheduled, states, strict=False):
            start, n = state.num_computed_tokens, state.num_scheduled_tokens
            span = prompt_span(request_id, len(input_ids), start, n, state.token_ids, state.num_prompt_tokens,
                               state.sampling.prompt_logprobs) if state.sampling.prompt_logprobs is not None else None
            if span is not None:
                spans.append(span)
            drafts = state.draft_token_ids
            input_ids.extend(state.token_ids[start:start + n - len(drafts)])
            input_ids.extend(drafts)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(state.block_ids)
            if start + n - len(drafts) == len(state.token_ids):  # reached the end of what it knows: sample
                sample_rows.extend(range(len(input_ids) - 1 - len(drafts), len(input_ids)))
                sample_ids.extend([request_id] * (len(drafts) + 1))
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device)
        positions = AttentionMetadata.positions(meta)
        tokens = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        grammars = [self.requests[r].grammar for r in sample_ids]
        masks = self.grammars.start_masks(grammars) if any(g is not None for g in grammars) else None  # beside the forward
        rows_alone(any(s.draft_token_ids for s in states))
        hidden = self.model(tokens, positions, self.pool.kv_caches, meta, self.backend)
        result = StepResult(step_id=plan.step_id, compiled_grammars=self._compiled_grammars())
        if spans:
            result.prompt_logprobs = prompt_logprobs(self.model.compute_logits, hidden, spans)
        for state in states:
            state.num_computed_tokens += state.num_scheduled_tokens
            state.num_scheduled_tokens = 0
        if sample_rows:
            sample_states = [self.requests[r] for r in sample_ids]
            params = [s.sampling for s in sample_states]
            num_outputs = [len(s.token_ids) - s.num_prompt_tokens for s in sample_states]
            drafting = any(s.draft_token_ids for s in sample_states)
            if masks is None and plain_greedy(params, num_outputs):  # the argmax straight from the model's logits
                tokens = self._greedy(hidden[sample_rows])
                rows = [SampledToken(r, t) for r, t in zip(sample_ids, tokens, strict=True)]
            else:
                histories = draft_histories(sample_ids, sample_states) if drafting else [s.token_ids for s in
                                                                                          sample_states]
                logits = self.model.compute_logits(hidden[sample_rows])
                rows = sample(logits, params, sample_ids, histories, [s.num_prompt_tokens for s in sample_states],
                              masks, self.model_config.eos_token_ids)
            if drafting:
                result.sampled, result.draft_tokens = accept_drafts(rows, [s.draft_token_ids for s in sample_states])
            else:
                result.sampled = rows
            accepted = {}
            for token in result.draft_tokens:
                accepted.setdefault(token.request_id, []).append(token.token_id)
            for token in result.sampled:
                state = self.requests[token.request_id]
                if state.draft_token_ids:  # rejected drafts' slots are overwritten by the next steps
                    state.num_computed_tokens -= len(state.draft_token_ids) - len(accepted.get(token.request_id, ()))
                    state.token_ids.extend(accepted.get(token.request_id, ()))
                    state.draft_token_ids = []
                state.token_ids.append(token.token_id)
                if state.grammar is not None:
                    state.grammar.accept(token.token_id)
        result.step_seconds = time.perf_counter() - started
        return result
