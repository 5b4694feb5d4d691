"""Speculative decoding on the scheduler's side: drafts, lookahead slots and the worker's verdict.

A request decoding alone (nothing in flight, every known token but the last computed) gets up to k
n-gram or suffix drafts within the step's leftover token budget; the step computes its last token and the
drafts (1 + d tokens) and the worker returns the accepted drafts plus one token. Rejected drafts'
KV slots stay with the request as spare slots (the kvstore holds num_computed_tokens + spare slots),
and the next steps use them before asking the kvstore for more, so no slot leaks or is counted twice.

With async scheduling a decoding request always has its next token in flight, so nothing is known to
draft from. A request that expects drafts (its last ones were accepted, or its known tokens end in a recurring
n-gram) is held out of the step planned while its token is in flight and drafts in the next; the others keep
the overlap. Where no draft pays at any rate (a large batch), decodes run multi-step plans (multi_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.services.scheduler.draft_cost import (
    DECAY,
    OVERALL_DECAY,
    PRIOR_RATE,
    Acceptance,
    choose_lengths,
    draft_threshold,
)
from pagedserve.services.scheduler.ngram_proposer import propose_ngram
from pagedserve.services.scheduler.request import Request, RequestStatus
from pagedserve.services.scheduler.step import CandidateStep
from pagedserve.services.scheduler.step_times import StepTimes
from pagedserve.services.scheduler.suffix_proposer import SuffixProposer
from pagedserve.shared.messages import SampledToken
from pagedserve.shared.speculative_config import PER_POS_KEY, SpeculativeConfig

# tokens without a lookup after all drafts were rejected: short, as a miss in quoted text is mostly one
# edited token; a request that keeps missing loses its lookups through its acceptance rate (_pays)
BACKOFF_TOKENS = 2


@dataclass
class SpecDecodeCounters:
    """vLLM's spec_decode counters: drafts (requests-steps with any), draft tokens, accepted ones,
    and accepted ones at each draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def count(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos.extend([0] * (num_drafted - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def totals(self) -> dict[str, int]:
        """Flat counters for the stats blob: spec_decode_* and ..._per_pos_<position>_total."""
        totals = {"spec_decode_num_drafts_total": self.num_drafts,
                  "spec_decode_num_draft_tokens_total": self.num_draft_tokens,
                  "spec_decode_num_accepted_tokens_total": self.num_accepted_tokens}
        for pos, count in enumerate(self.accepted_per_pos):
            totals[f"{PER_POS_KEY}{pos}_total"] = count
        return totals


def can_speculate(request: Request) -> bool:
    """Decoding with nothing in flight, and not opted out; structured output opts out too (its matcher
    cannot roll back)."""
    return (request.status is RequestStatus.RUNNING and not request.num_pending_tokens and may_draft(request)
            and request.num_computed_tokens == request.num_tokens - 1)


def may_draft(request: Request) -> bool:
    return request.sampling.speculative_decoding and request.sampling.guided is None


NO_VERDICTS = Acceptance()  # read only: a request's own counts start at its first verdict


class Speculator:
    def __init__(self, config: SpeculativeConfig | None) -> None:
        self.config = config
        self.counters = SpecDecodeCounters()
        self.suffix = None
        self._acceptance: dict[str, Acceptance] = {}  # requests with verdicts; finished() drops them
        self._overall = Acceptance()
        self._last_step = (1, 1)  # (tokens, candidates) of the last step planned, before drafts
        self.step_times = StepTimes(config.step_costs, config.learn_step_costs) if config and config.step_costs else None
        if config is not None and config.method == "suffix":
            self.suffix = SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_spec_factor,
                                         config.suffix_decoding_min_token_prob,
                                         config.suffix_decoding_max_cached_requests)

    def finished(self, request: Request) -> None:
        """A request ended: suffix decoding drafts from its output for later requests."""
        self._acceptance.pop(request.request_id, None)
        if self.suffix is not None:
            self.suffix.remember(request.output_token_ids)

    def plan(self, step: CandidateStep, token_budget: int, max_model_len: int) -> None:
        """Add drafts to the step's decoding candidates while budget is left, and spend spare slots:
        step.num_scheduled gets each changed candidate's token count, its num_new_tokens the new slots."""
        if self.config is not None:
            self._hold_back(step, max_model_len)
        num_tokens = sum(c.num_new_tokens for _, c in step.candidates)
        self._last_step = (num_tokens, len(step.candidates))
        drafts = self._drafts(step, token_budget - num_tokens, max_model_len) if self.config is not None else {}
        for request, candidate in step.candidates:
            if candidate.is_waiting or request.is_fresh_fork:
                continue
            num_scheduled = candidate.num_new_tokens
            if request.request_id in drafts:
                request.expects_drafts = bool(drafts[request.request_id])
                if drafts[request.request_id]:
                    step.drafts[request.request_id] = drafts[request.request_id]
                    num_scheduled += len(drafts[request.request_id])
            if request.num_spare_slots or num_scheduled != candidate.num_new_tokens:
                step.num_scheduled[request.request_id] = num_scheduled
                reused = min(request.num_spare_slots, num_scheduled)
                request.num_spare_slots -= reused
                candidate.num_new_tokens = num_scheduled - reused

    def _drafts(self, step: CandidateStep, budget_left: int, max_model_len: int) -> dict[str, list[int]]:
        """Drafts by request id for every decoding candidate that may draft ([] if none pay or recur)."""
        proposals: list[tuple[Request, list[int]]] = []
        self._overall.fade(OVERALL_DECAY)
        threshold = self._threshold()
        for request, candidate in step.candidates:
            if candidate.is_waiting or request.is_fresh_fork or candidate.num_new_tokens != 1:
                continue
            if request.request_id in self._acceptance:
                self._acceptance[request.request_id].fade(DECAY)
            if can_speculate(request):  # no lookup where no draft pays
                k = min(budget_left, self._room(request, max_model_len)) if self._rate(request) > threshold else 0
                proposals.append((request, self._propose(request, k)))
        if self.step_times is not None and any(d for _, d in proposals):
            num_tokens, num_sampled = self._last_step
            offers = [(self._rate(request), len(d)) for request, d in proposals]
            lengths = choose_lengths(self.step_times.table(), num_tokens, num_sampled, offers)
            proposals = [(request, d[:n]) for (request, d), n in zip(proposals, lengths, strict=True)]
        drafts = {}
        for request, draft in proposals:
            drafts[request.request_id] = draft[:max(budget_left, 0)]
            budget_left -= len(drafts[request.request_id])
        return drafts

    def _rate(self, request: Request) -> float:
        return self._acceptance.get(request.request_id, NO_VERDICTS).rate(self._overall.rate(PRIOR_RATE))

    def holds(self, request: Request, max_model_len: int) -> bool:
        """Whether a step planned now leaves this request out, to draft once its token in flight is known."""
        if (self.config is None or not request.num_pending_tokens or not may_draft(request)
                or request.is_fresh_fork or self._room(request, max_model_len) - request.num_pending_tokens < 1):
            return False
        if not self._pays(request):
            return False
        return request.expects_drafts or (request.num_output_tokens >= request.spec_backoff_until
                                          and bool(self._propose(request, 1)))

    def drafting_off(self) -> bool:
        """No speculation, or no draft pays in a step like the last one planned at any rate: multi-step may run."""
        return self.config is None or self._threshold() > 1.0

    def _pays(self, request: Request) -> bool:
        """Some drafts would pay in a step like the last one planned."""
        return self._rate(request) > self._threshold()

    def _threshold(self) -> float:
        if self.step_times is None:
            return -1.0
        num_tokens, num_sampled = self._last_step
        return draft_threshold(self.step_times.table(), max(num_tokens, 1), max(num_sampled, 1),
                               self.config.num_speculative_tokens)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if self.step_times is not None:
            self.step_times.observe(num_tokens, seconds)

    def _hold_back(self, step: CandidateStep, max_model_len: int) -> None:
        kept = []
        for request, candidate in step.candidates:
            if not candidate.is_waiting and self.holds(request, max_model_len):
                request.expects_drafts = True  # no second lookup until it has drafted
                request.num_kv_known_tokens = candidate.token_ids_start  # its new tokens go next time
            else:
                kept.append((request, candidate))
        step.candidates = kept

    def _room(self, request: Request, max_model_len: int) -> int:
        """Drafts that cannot overrun max_tokens or the context even if all are accepted."""
        return min(self.config.num_speculative_tokens,
                   request.sampling.max_tokens - request.num_output_tokens - 1,
                   max_model_len - request.num_tokens - 1)

    def _propose(self, request: Request, k: int) -> list[int]:
        if k < 1:
            return []
        if self.suffix is not None:
            return self.suffix.propose(request.all_token_ids, k)
        c = self.config
        return propose_ngram(request.all_token_ids, c.prompt_lookup_min, c.prompt_lookup_max, k)

    def verdict(self, request: Request, drafts: list[int], accepted: list[SampledToken]) -> list[SampledToken]:
        """The accepted drafts, checked against what was drafted; rolls back the rejected slots."""
        if [t.token_id for t in accepted] != drafts[:len(accepted)]:
            raise ValueError(f"step result accepts tokens that were not drafted for {request.request_id!r}")
        num_rejected = len(drafts) - len(accepted)
        if request.status is RequestStatus.RUNNING:  # a request preempted meanwhile holds no slots
            request.num_computed_tokens -= num_rejected
            request.num_spare_slots += num_rejected
        self.counters.count(len(drafts), len(accepted))
        self._overall.add(len(drafts), len(accepted))
        self._acceptance.setdefault(request.request_id, Acceptance()).add(len(drafts), len(accepted))
        request.expects_drafts = bool(accepted)
        if not accepted:  # a lookup that matched and missed: let async scheduling run it for a while
            request.spec_backoff_until = request.num_output_tokens + len(accepted) + BACKOFF_TOKENS
        return accepted
