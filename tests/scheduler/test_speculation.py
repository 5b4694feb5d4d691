"""Speculative decoding through the scheduler and the real kvstore BlockManager, with a worker double
that verifies drafts as the real one does and models the KV pool slot by slot: every token a row
reads must sit in its slot with the right position (so a rejected draft's slot is rewritten before
anyone reads it, and a shared prefix block holds what its hash says). Greedy output equals plain
autoregressive decoding, alone, batched, with prefix caching and with preemption; slots never leak."""

from __future__ import annotations

import zlib
from collections import deque
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.services.kvstore.block_manager import BlockManager
from pagedserve.services.scheduler.policies.fcfs import FCFSPolicy
from pagedserve.services.scheduler.request import Request
from pagedserve.services.scheduler.scheduler import Scheduler
from pagedserve.services.scheduler.speculation import Speculator
from pagedserve.shared.messages import SampledToken, SamplingParams, StepPlan, StepResult
from pagedserve.shared.speculative_config import SpeculativeConfig

BLOCK_SIZE = 4
VOCAB = 7  # few tokens: the fake model's output repeats, so drafts are often right and sometimes wrong
EOS = 6
NGRAM = SpeculativeConfig("ngram", 3, 1, 3)
SUFFIX = SpeculativeConfig("suffix", 6, 5, 5, suffix_decoding_max_spec_factor=2.0,
                           suffix_decoding_max_cached_requests=2)


def next_token(history: list[int]) -> int:
    """The fake model: the next token from the last two."""
    return zlib.crc32(bytes(history[-2:])) % VOCAB


def autoregressive(prompt: list[int], params: SamplingParams) -> list[int]:
    out: list[int] = []
    while len(out) < params.max_tokens:
        out.append(next_token(prompt + out))
        if out[-1] == EOS and not params.ignore_eos:
            break
    return out


class VerifyingWorker:
    """Keeps each request's tokens from the plan's diffs and a slot -> (position, token) pool."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.slots: dict[int, tuple[int, int]] = {}
        self.num_draft_steps = 0
        self.num_multi_steps = 0  # further steps of multi-step plans

    def _slot(self, request_id: str, position: int) -> int:
        return self.blocks[request_id][position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            for table in (self.tokens, self.blocks, self.computed):
                table.pop(request_id, None)
        assert not plan.block_copies
        work = []
        for new in plan.new_requests:
            self.tokens[new.request_id], self.blocks[new.request_id] = list(new.token_ids), list(new.block_ids)
            work.append((new.request_id, new.num_computed_tokens, new.num_scheduled_tokens, []))
        for cached in plan.cached_requests:
            assert cached.num_computed_tokens == self.computed[cached.request_id]  # rolled back alike
            self.blocks[cached.request_id] += cached.new_block_ids
            work.append((cached.request_id, cached.num_computed_tokens, cached.num_scheduled_tokens,
                         list(cached.draft_token_ids)))
            assert cached.num_steps == 1 or (cached.num_scheduled_tokens == 1 and not cached.draft_token_ids)
        result = self._step(plan.step_id, work)
        more = {c.request_id: c.num_steps - 1 for c in plan.cached_requests if c.num_steps > 1}
        while any(more.values()):  # a multi-step plan: its further decode steps, the last token fed back
            work = [(r, self.computed[r], 1, []) for r, n in more.items() if n > 0]
            more = {r: n - 1 for r, n in more.items()}
            self.num_multi_steps += 1
            step = self._step(plan.step_id, work)
            result.sampled += step.sampled
        return result

    def _step(self, step_id: int, work: list[tuple[str, int, int, list[int]]]) -> StepResult:
        result = StepResult(step_id)
        for request_id, start, n, drafts in work:  # as the forward pass: the whole step's K/V first
            tokens = self.tokens[request_id]
            inputs = tokens[start:start + n - len(drafts)] + drafts
            assert len(self.blocks[request_id]) * BLOCK_SIZE >= start + n
            for i, token in enumerate(inputs):
                self.slots[self._slot(request_id, start + i)] = (start + i, token)
        for request_id, start, n, drafts in work:
            tokens = self.tokens[request_id]
            for position in range(start):  # what attention reads: every earlier slot, correct
                assert self.slots[self._slot(request_id, position)] == (position, tokens[position])
            self.computed[request_id] = start + n
            if start + n - len(drafts) != len(tokens):
                continue
            self.num_draft_steps += bool(drafts)
            accepted = 0
            while accepted < len(drafts) and next_token(tokens + drafts[:accepted]) == drafts[accepted]:
                accepted += 1
            result.draft_tokens += [SampledToken(request_id, t) for t in drafts[:accepted]]
            tokens += drafts[:accepted]
            tokens.append(next_token(tokens))
            result.sampled.append(SampledToken(request_id, tokens[-1]))
            self.computed[request_id] -= len(drafts) - accepted
        return result


def run(prompts: list[list[int]], params: list[SamplingParams], num_blocks: int, prefix_caching: bool,
        speculative: SpeculativeConfig | None, budget: int = 64,
        steps_in_flight: int = 1, num_scheduler_steps: int = 1) -> tuple[list[list[int]], Scheduler, int]:
    """Drive scheduler, BlockManager and worker as the scheduler service does: with 2 steps in flight
    the next is planned (if it pays) before the oldest result is read."""
    scheduler = Scheduler(FCFSPolicy(), max_num_batched_tokens=budget, max_model_len=256,
                          long_prefill_token_threshold=0, speculative_config=speculative,
                          max_steps_in_flight=steps_in_flight, num_scheduler_steps=num_scheduler_steps)
    manager = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=prefix_caching, watermark=0.0)
    worker = run.worker = VerifyingWorker()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        scheduler.add_request(Request(f"r{i}", prompt, p, [EOS], arrival_time=0.0))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    planned: deque[StepPlan] = deque()
    for _ in range(4000):
        if not scheduler.has_requests():
            break
        while scheduler.can_schedule() and (not planned or scheduler.has_work_ahead()):
            planned.append(scheduler.on_alloc(manager.step(scheduler.schedule())))
            manager.check_integrity()
        for delta in scheduler.on_result(worker.execute(planned.popleft())):
            outputs[delta.request_id] += delta.new_token_ids
    assert not scheduler.has_requests()
    manager.check_integrity()
    assert manager.num_free_blocks == num_blocks  # every slot, spare ones too, given back
    return [outputs[f"r{i}"] for i in range(len(prompts))], scheduler, worker.num_draft_steps


PROMPT = [1, 2, 3, 1, 2, 3, 4, 1, 2]


def test_a_lone_request_decodes_the_same_tokens_with_drafts_and_counts_them():
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    (out,), scheduler, draft_steps = run([PROMPT], [params], 64, True, NGRAM)
    assert out == autoregressive(PROMPT, params)
    counters = scheduler._speculator.counters
    assert draft_steps == counters.num_drafts > 0
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert counters.accepted_per_pos[0] >= counters.accepted_per_pos[-1]
    assert sum(counters.accepted_per_pos) == counters.num_accepted_tokens
    totals = scheduler.spec_decode_totals()
    assert totals["spec_decode_num_drafts_total"] == counters.num_drafts
    assert totals["spec_decode_num_accepted_tokens_per_pos_0_total"] == counters.accepted_per_pos[0]


def test_off_by_default_no_drafts():
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    (out,), scheduler, draft_steps = run([PROMPT], [params], 64, True, None)
    assert out == autoregressive(PROMPT, params) and draft_steps == 0
    assert scheduler.spec_decode_totals()["spec_decode_num_drafts_total"] == 0


def test_a_stop_token_among_accepted_drafts_ends_the_request_there():
    params = SamplingParams(max_tokens=60)
    prompts = [[a, b, a, b, c] for a in range(3) for b in range(3, 6) for c in range(2)]
    outs, _, _ = run(prompts, [params] * len(prompts), 256, False, NGRAM)
    assert outs == [autoregressive(p, params) for p in prompts]
    assert any(o[-1] == EOS and len(o) < 60 for o in outs)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(st.lists(st.integers(0, VOCAB - 2), min_size=1, max_size=14), min_size=1, max_size=5),
       max_tokens=st.lists(st.integers(1, 30), min_size=5, max_size=5),
       num_blocks=st.integers(12, 40), prefix_caching=st.booleans(), budget=st.sampled_from([4, 9, 64]),
       k=st.integers(1, 5), steps_in_flight=st.sampled_from([1, 2]), suffix=st.booleans())
def test_any_batch_pool_and_budget_give_the_autoregressive_tokens(prompts, max_tokens, num_blocks, prefix_caching,
                                                                 budget, k, steps_in_flight, suffix):
    params = [SamplingParams(max_tokens=m, ignore_eos=i % 2 == 0) for i, m in enumerate(max_tokens[:len(prompts)])]
    config = SpeculativeConfig("suffix", k, 5, 5, 3, 2.0, 0.3, 2) if suffix else SpeculativeConfig("ngram", k, 1, 2)
    outs, scheduler, _ = run(prompts, params, num_blocks, prefix_caching, config, budget, steps_in_flight)
    assert outs == [autoregressive(p, q) for p, q in zip(prompts, params, strict=True)]


@pytest.mark.parametrize("config", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_preempted_requests_with_spare_slots_resume_with_the_same_tokens(config):
    prompts = [PROMPT, PROMPT[::-1], [4, 4, 1, 4, 4, 2]]
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] * 3
    outs, scheduler, draft_steps = run(prompts, params, 14, True, config)
    assert outs == [autoregressive(p, q) for p, q in zip(prompts, params, strict=True)]
    assert scheduler.stats().num_preemptions_total > 0 and draft_steps > 0


@pytest.mark.parametrize("config", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_async_scheduling_holds_a_drafting_request_back_and_still_drafts(config):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    (out,), scheduler, draft_steps = run([PROMPT], [params], 64, True, config, steps_in_flight=2)
    assert out == autoregressive(PROMPT, params)
    assert draft_steps > 0 and scheduler._speculator.counters.num_accepted_tokens > 0


def test_suffix_drafts_from_finished_requests_outputs():
    speculator = Speculator(SUFFIX)
    done = Request("a", [1, 2], SamplingParams(max_tokens=8), [EOS], arrival_time=0.0)
    done.output_token_ids.extend([5, 6, 0, 5, 1, 2])
    speculator.finished(done)
    new = Request("b", [4, 5, 6, 0, 5], SamplingParams(max_tokens=8), [EOS], arrival_time=0.0)
    assert speculator._propose(new, 3) == [1, 2]
    prompts = [[3, 5, 0, 4, 1], [2, 2, 4], [1, 0]]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    outs, scheduler, _ = run(prompts, [params] * 3, 64, True, replace(SUFFIX, step_costs=None))
    assert outs == [autoregressive(p, params) for p in prompts]
    cache = scheduler._speculator.suffix.cache  # the outputs of the last 2 to finish
    assert len(cache) == 2 and cache[0] != cache[1] and all(seq in outs for seq in cache)


def test_a_request_that_opts_out_never_drafts():
    params = SamplingParams(max_tokens=40, ignore_eos=True, speculative_decoding=False)
    (out,), scheduler, draft_steps = run([PROMPT], [params], 64, True, NGRAM)
    assert out == autoregressive(PROMPT, params) and draft_steps == 0
    both = [params, SamplingParams(max_tokens=40, ignore_eos=True)]
    outs, scheduler, draft_steps = run([PROMPT, PROMPT], both, 64, True, NGRAM, steps_in_flight=2)
    assert outs == [autoregressive(PROMPT, p) for p in both] and draft_steps > 0


def test_no_drafts_where_step_time_grows_as_fast_as_tokens():
    linear = replace(NGRAM, step_costs=((1, 1.0), (2, 2.0)))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    (out,), scheduler, draft_steps = run([PROMPT], [params], 64, True, linear, steps_in_flight=2)
    assert out == autoregressive(PROMPT, params) and draft_steps == 0


def test_a_fixed_draft_length_drafts_whenever_a_lookup_matches():
    """The cost model drafts less after a rejection and more as drafts are accepted: fewer drafts,
    far fewer rejected, the same tokens."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    counts = []
    for config in (NGRAM, replace(NGRAM, step_costs=None)):
        (out,), scheduler, draft_steps = run([PROMPT], [params], 64, True, config)
        assert out == autoregressive(PROMPT, params)
        c = scheduler._speculator.counters
        counts.append((draft_steps, c.num_draft_tokens, c.num_accepted_tokens))
        assert scheduler._speculator._acceptance == {}  # dropped as requests finish
    assert counts == [(8, 20, 18), (12, 34, 25)]


@pytest.mark.parametrize("steps_in_flight", [1, 2])
def test_decodes_run_several_steps_a_plan_where_no_draft_pays(steps_in_flight):
    """A step time that grows as fast as its tokens: no draft ever pays, so the decodes run multi-step
    plans, as without speculation, and the tokens are the same."""
    linear = replace(NGRAM, step_costs=((1, 1.0), (2, 2.0)))
    params = [SamplingParams(max_tokens=30, ignore_eos=True), SamplingParams(max_tokens=17, ignore_eos=True)]
    outs, scheduler, draft_steps = run([PROMPT, PROMPT[2:]], params, 64, True, linear, steps_in_flight=steps_in_flight,
                                       num_scheduler_steps=4)
    assert outs == [autoregressive(p, q) for p, q in zip([PROMPT, PROMPT[2:]], params, strict=True)]
    assert draft_steps == 0 and run.worker.num_multi_steps > 0


def test_drafting_keeps_one_step_plans_where_drafts_pay():
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    (out,), scheduler, draft_steps = run([PROMPT], [params], 64, True, NGRAM, num_scheduler_steps=4)
    assert out == autoregressive(PROMPT, params)
    assert draft_steps > 0 and run.worker.num_multi_steps == 0 and not scheduler._speculator.drafting_off()
