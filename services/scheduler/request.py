"""One request as the scheduler sees it: token counters and a status, no phases.

num_computed_tokens counts steps in flight too; their sampled tokens are num_pending_tokens, not in
num_tokens. RUNNING with nothing in flight: 0 <= num_computed_tokens < num_tokens_to_compute.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.shared.block_hash import BlockHashes
from pagedserve.shared.messages import SampledToken, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in waiting, holds nothing, recomputes from scratch
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FORKED = "forked"  # a fork parent whose prefill is done: its n children carry on

    __hash__ = object.__hash__  # members are singletons; Enum's hashes the name in Python, per lookup

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False, slots=True, weakref_slot=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    tenant: str | None = None
    cache_salt: str = ""  # the kvstore shares blocks only within one salt
    output_token_ids: list[int] = field(default_factory=list, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    num_cached_tokens: int = field(default=0, init=False)  # prefix-cache hit at the first admission
    num_preemptions: int = field(default=0, init=False)
    arrival_seq: int = field(default=0, init=False)
    is_fresh_fork: bool = field(default=False, init=False)  # a fork child not granted a step yet
    num_pending_tokens: int = field(default=0, init=False)
    num_kv_known_tokens: int = field(default=0, init=False)  # prompt + output tokens the kvstore was told
    num_streamed_tokens: int = field(default=0, init=False)
    num_spare_slots: int = field(default=0, init=False)  # KV slots held past num_computed_tokens (rejected drafts)
    expects_drafts: bool = field(default=False, init=False)  # async scheduling waits for its token to draft
    spec_backoff_until: int = field(default=0, init=False)  # output length before a lookup may hold it again
    unstreamed_logprobs: list[SampledToken] = field(default_factory=list, init=False)
    # its known tokens' block hashes, from its placement on (workers.py); None: the kvstore hashes them
    block_hashes: BlockHashes | None = field(default=None, init=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_fork_parent(self) -> bool:
        return self.sampling.n > 1

    @property
    def num_tokens_to_compute(self) -> int:
        """Every token, pending ones too; a fork parent stops before its last prompt token."""
        return self.num_tokens - 1 if self.is_fork_parent else self.num_tokens + self.num_pending_tokens

    def num_tokens_wanted(self, max_model_len: int) -> int:
        """Tokens a step could compute now: 0 while all is in flight or pending tokens hit a limit."""
        pending, num_output = self.num_pending_tokens, len(self.output_token_ids)  # per running request, per step
        num_tokens = len(self.prompt_token_ids) + num_output
        if pending and (num_output + pending >= self.sampling.max_tokens or num_tokens + pending >= max_model_len):
            return 0
        return (num_tokens - 1 if self.sampling.n > 1 else num_tokens + pending) - self.num_computed_tokens

    def token_ids_between(self, start: int, stop: int) -> list[int]:
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:stop - num_prompt]
        return self.prompt_token_ids[start:stop] + self.output_token_ids[:max(0, stop - num_prompt)]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def check_fresh(self, max_model_len: int) -> None:
        if self.status is not RequestStatus.WAITING or self.num_computed_tokens:
            raise ValueError("only a fresh WAITING request can be added")
        if not 0 < self.num_tokens < max_model_len:
            raise ValueError(f"prompt of {self.num_tokens} tokens must be within [1, {max_model_len})")
        if self.sampling.max_tokens < 1 or self.sampling.n < 1:
            raise ValueError("max_tokens must be >= 1 and n must be >= 1")
        if self.is_fork_parent and self.output_token_ids:
            raise ValueError("n > 1 only for a fresh prompt: a resubmission is one sequence each")

    def admit(self, num_cached_tokens: int) -> None:
        """WAITING/PREEMPTED -> RUNNING after its prefix-cache hit; the last token is always computed."""
        self.num_computed_tokens = min(num_cached_tokens, self.num_tokens - 1)
        self.num_kv_known_tokens = self.num_tokens_to_compute
        if self.status is RequestStatus.WAITING:
            self.num_cached_tokens = self.num_computed_tokens
        self.status = RequestStatus.RUNNING

    def preempt(self) -> None:
        """RUNNING -> PREEMPTED: it recomputes later; a step in flight still delivers its pending token."""
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.num_kv_known_tokens = 0
        self.num_spare_slots = 0
        self.num_preemptions += 1
        self.is_fresh_fork = False

    def stop_status(self, max_model_len: int) -> RequestStatus | None:
        """The finished status after the last sampled token, or None; the stopping token stays in the output."""
        output, sampling = self.output_token_ids, self.sampling  # per sampled token: no properties
        if not output:
            return None
        last_token_id = output[-1]
        if not sampling.ignore_eos and last_token_id in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last_token_id in sampling.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(output) >= sampling.max_tokens or len(self.prompt_token_ids) + len(output) >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
