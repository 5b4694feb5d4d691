"""Typed messages between the services, one per step per hop, packed by `pagedserve.shared.codec` with `VERSION`.

Diffs, not state: a request's tokens reach the worker once (NewRequestData), then only counts and new block ids.
Per-step messages are msgspec Structs: a dataclass's wire map, faster, gc=False (trees: never cycles).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

import msgspec

VERSION = 1


@dataclass
class GuidedDecoding:
    """Structured output, validated at the api: kind "json" (spec: a JSON schema), "json_object" (any
    JSON object; spec ""), "regex", "grammar" (xgrammar EBNF/GBNF; a choice list arrives as one), or
    "structural_tag" (xgrammar's structural tag as JSON: strict tools in tool_choice "auto")."""

    kind: str
    spec: str = ""

    @property
    def key(self) -> str:
        return _grammar_key(self.kind, self.spec)


@functools.lru_cache(maxsize=1024)
def _grammar_key(kind: str, spec: str) -> str:
    return hashlib.sha256(f"{kind}\0{spec}".encode()).hexdigest()[:16]


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return; None: none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    guided: GuidedDecoding | None = None  # constrained decoding (sampling/grammar.py)
    repetition_penalty: float = 1.0
    # n sequences from one prompt, prefilled once; the i-th gets seed + i (parallel_sampling.py)
    n: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-100..100)
    prompt_logprobs: int | None = None  # logprobs of the prompt's tokens, with this many top ones; None: none
    min_tokens: int = 0  # EOS and stop_token_ids are masked out until this many tokens were generated
    speculative_decoding: bool = True  # False: never drafts for this request, whatever --speculative-config says


class AllocCandidate(msgspec.Struct, gc=False):
    """A request that wants this step, in policy order (a waiting one before the running ones it may
    displace). num_new_tokens: to compute now (nothing cached assumed); num_tokens: all known, which
    must fit (plus a watermark) to admit; token_ids: a waiting request's tokens, or new ones from
    token_ids_start (-1: this step's slots), hashed as blocks fill; cache_salt keys the prefix hash,
    so different salts never share a block. block_hashes: the hashes of the full blocks token_ids
    complete (the first is block token_ids_start // block_size; a waiting request's: all of them),
    hashed once by the scheduler; empty: the kvstore hashes the tokens itself."""

    request_id: str
    num_new_tokens: int
    num_tokens: int
    is_waiting: bool = False
    token_ids: list[int] = msgspec.field(default_factory=list)
    cache_salt: str = ""
    token_ids_start: int = -1
    block_hashes: list[bytes] = msgspec.field(default_factory=list)


class Fork(msgspec.Struct, gc=False):
    """The parent's table becomes each child's (partial last block copy-on-write), then is dropped."""

    parent_id: str
    child_ids: list[str]


class AllocRequest(msgspec.Struct, gc=False):
    """scheduler -> kvstore, one per step: forks first, then frees, then allocation."""

    step_id: int
    free_request_ids: list[str] = msgspec.field(default_factory=list)
    candidates: list[AllocCandidate] = msgspec.field(default_factory=list)
    forks: list[Fork] = msgspec.field(default_factory=list)
    # a (re)started scheduler or a lost worker: forget every request, all blocks free
    reset: bool = False
    worker_id: str = ""  # whose pool: the kvstore keeps one per worker; step ids count per worker
    tier_written: list[bytes] = msgspec.field(default_factory=list)  # StepResult.tier_written since the last request
    tier_filled: list[tuple[str, int, bytes]] = msgspec.field(default_factory=list)  # StepResult.tier_filled, likewise
    num_free_seqs: int = -1  # seats a waiting candidate may take before displacing; -1: no bound


ALLOC_OK = "ok"
ALLOC_PREEMPTED = "preempted"  # was running; all its blocks were freed to make room
ALLOC_NOT_ADMITTED = "not_admitted"  # was waiting; stays waiting, holds nothing


class AllocResult(msgspec.Struct, gc=False):
    request_id: str
    status: str
    # appended blocks; the whole table on admission or a fork's first grant
    new_block_ids: list[int] = msgspec.field(default_factory=list)
    num_cached_tokens: int = 0  # prefix-cache hit for a newly admitted request (pool and tier)
    # (block index, hash) of the cached blocks to load from the offload tier (the last of the hit)
    tier_loads: list[tuple[int, bytes]] = msgspec.field(default_factory=list)


class AllocReply(msgspec.Struct, gc=False):
    """kvstore -> scheduler, per step: results in candidate order, plus KV events since the last
    reply (blocks_*: concatenated KEY_BYTES hash prefixes; all_blocks_cleared applies first)."""

    step_id: int
    results: list[AllocResult] = msgspec.field(default_factory=list)
    block_copies: list[tuple[int, int]] = msgspec.field(default_factory=list)  # (src, dst) copy-on-write
    num_free_blocks: int = 0
    num_blocks: int = 0
    worker_id: str = ""
    blocks_stored: bytes = b""
    blocks_removed: bytes = b""
    all_blocks_cleared: bool = False
    # (request id, block index, hash): full blocks the worker writes to the offload tier after the step
    tier_stores: list[tuple[str, int, bytes]] = msgspec.field(default_factory=list)
    # (request id, block index, parent hash): blocks full after the step whose last token only the worker knows
    tier_fills: list[tuple[str, int, bytes]] = msgspec.field(default_factory=list)
    # the offload tier's own events (it is every worker's), as blocks_*, on whichever reply comes next
    tier_blocks_stored: bytes = b""
    tier_blocks_removed: bytes = b""
    tier_blocks_whole: bool = False  # tier_blocks_stored lists every block the tier holds


KEY_BYTES = 8  # a KV event's block key: the first bytes of its SHA-256 prefix hash


class NewRequestData(msgspec.Struct, gc=False):
    """First time the worker sees a request (new or resumed): all known tokens, the whole block
    table; num_output_tokens of token_ids were generated (penalties count them apart)."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: SamplingParams
    num_output_tokens: int = 0
    # (block index, hash) to load from the offload tier before computing; a miss is computed instead
    tier_loads: list[tuple[int, bytes]] = msgspec.field(default_factory=list)


class CachedRequestData(msgspec.Struct, gc=False):
    """A request the worker already holds: only the diff travels."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    # speculative decoding: the last num_scheduled_tokens - 1 inputs are these guesses, verified in the step
    draft_token_ids: list[int] = msgspec.field(default_factory=list)
    # multi-step: a decode (one token, no drafts) runs this many steps in its granted slots, each fed the
    # last one's token; an EOS or stop token ends them, so the result holds 1..num_steps tokens, in order
    num_steps: int = 1


class StepPlan(msgspec.Struct, gc=False):
    step_id: int
    new_requests: list[NewRequestData] = msgspec.field(default_factory=list)
    cached_requests: list[CachedRequestData] = msgspec.field(default_factory=list)
    # finished, aborted or preempted since the last plan: the worker drops their state
    finished_request_ids: list[str] = msgspec.field(default_factory=list)
    block_copies: list[tuple[int, int]] = msgspec.field(default_factory=list)
    reset: bool = False  # drop every request's state before applying this plan
    tier_stores: list[tuple[str, int, bytes]] = msgspec.field(default_factory=list)  # as AllocReply.tier_stores
    tier_fills: list[tuple[str, int, bytes]] = msgspec.field(default_factory=list)  # as AllocReply.tier_fills
    stores_lag: int = 0  # the result waits for the tier writes of steps <= step_id - stores_lag
    # grammars to compile now, ahead of their requests, which the scheduler holds until compiled
    compile_grammars: list[GuidedDecoding] = msgspec.field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(
            r.num_scheduled_tokens for r in self.cached_requests
        )


class SampledToken(msgspec.Struct, gc=False):
    request_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class PromptLogprobs(msgspec.Struct, gc=False):
    """The logprobs of prompt tokens first .. first + len(tokens) - 1 (token 0 has none), from one
    prefill chunk; a recomputed chunk sends them again (the api keeps the first)."""

    request_id: str
    first: int
    tokens: list[SampledToken] = msgspec.field(default_factory=list)
    ranks: list[int] = msgspec.field(default_factory=list)  # each token's rank in its row (1: the most likely)


class StepResult(msgspec.Struct, gc=False):
    """One per step: a token for each request that reached the end of its known tokens (num_steps: 1..n)."""

    step_id: int
    sampled: list[SampledToken] = msgspec.field(default_factory=list)
    worker_id: str = ""  # who ran it: the results stream is shared by every worker
    num_tier_loaded_blocks: int = 0  # loaded from the offload tier for this step
    num_tier_missed_blocks: int = 0  # planned loads the tier could not give: computed instead
    tier_load_seconds: float = 0.0  # waiting on the tier's MGET for this step
    tier_loaded_bytes: int = 0
    num_tier_stored_blocks: int = 0  # writes to the tier finished since the last result
    tier_stored_bytes: int = 0
    tier_store_seconds: float = 0.0  # their pipelines' time, off the step's critical path
    tier_written: list[bytes] = msgspec.field(default_factory=list)  # hashes of planned stores written since the last result
    tier_filled: list[tuple[str, int, bytes]] = msgspec.field(default_factory=list)  # (request id, index, hash) written
    prompt_logprobs: list[PromptLogprobs] = msgspec.field(default_factory=list)  # prefill chunks that asked
    # accepted draft tokens, each request's in order; they precede its token in `sampled`
    draft_tokens: list[SampledToken] = msgspec.field(default_factory=list)
    compiled_grammars: list[str] = msgspec.field(default_factory=list)  # keys of plans' grammars compiled (or failed)
    step_seconds: float = 0.0  # the worker's time for the step's forward and sampling; 0: not measured


class RequestDelta(msgspec.Struct, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[SampledToken] = msgspec.field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # passed on from the worker as it computed them


class DeltaBatch(msgspec.Struct, gc=False):
    """scheduler -> one api process, one per step: the deltas of that api's requests."""

    step_id: int
    deltas: list[RequestDelta] = msgspec.field(default_factory=list)


@dataclass
class SubmitRequest:
    request_id: str
    api_id: str  # which api process gets this request's deltas
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float  # wall clock (time.time()) at the api
    priority: int = 0
    tenant: str | None = None
    # tokens already delivered: an api resubmitting to a restarted scheduler resumes from here
    output_token_ids: list[int] = field(default_factory=list)
    cache_salt: str = ""  # see AllocCandidate.cache_salt


@dataclass
class PrefixCacheReset:
    """api -> scheduler -> kvstore, in order with submissions: forget every cached prefix (CommandReply)."""

    command_id: str
    api_id: str


@dataclass
class AbortRequest:
    request_id: str
    reason: str = "abort"


@dataclass
class SetPolicy:
    """api -> scheduler, in order with submissions: swap the policy between steps (CommandReply)."""

    command_id: str
    api_id: str
    name: str
    options: dict = field(default_factory=dict)


@dataclass
class CommandReply:
    """The answer to an admin command, on the deltas stream of the api that sent it: the scheduler's
    to SetPolicy (result: the policy in force, {"name", "options"}), the kvstore's to
    PrefixCacheReset (result: its pools' num_cached_blocks and num_prefix_cache_resets after it)."""

    command_id: str
    ok: bool
    result: dict = field(default_factory=dict)
    error: str = ""


@dataclass
class WorkerHello:
    """worker -> scheduler/kvstore when it starts: the pool it owns."""

    worker_id: str
    num_blocks: int
    block_size: int
    model: str
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    kv_tier_namespace: str = ""  # the offload tier's key for this pool's block format ("" : no tier)
    kv_block_bytes: int = 0  # one block's contents, every layer
