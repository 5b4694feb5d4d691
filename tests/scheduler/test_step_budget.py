"""How build_candidates shares one step's token budget when a long prompt prefills:
decodes first, one prefill's chunk capped (and shrinking with its context), the rest to
the waiting requests. Pure: Request objects and the step builder, no stack."""

import pytest

from pagedserve.services.scheduler.step import build_candidates, prefill_chunk_cap
from tests.scheduler.fakes import make_request

MAX_MODEL_LEN = 16384


def _running(request_id: str, num_prompt_tokens: int, num_computed_tokens: int, max_tokens: int = 4):
    request = make_request(request_id, num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens)
    request.admit(0)
    request.num_computed_tokens = num_computed_tokens
    request.num_kv_known_tokens = num_computed_tokens
    return request


def _decode(request_id: str, num_prompt_tokens: int = 20):
    return _running(request_id, num_prompt_tokens, num_prompt_tokens - 1)


def _granted(running, waiting, token_budget=2048, threshold=256, num_free_seqs=64) -> dict[str, int]:
    step = build_candidates(0, running, waiting, num_free_seqs, token_budget, MAX_MODEL_LEN, threshold)
    granted = {candidate.request_id: candidate.num_new_tokens for _, candidate in step.candidates}
    assert sum(granted.values()) <= token_budget
    return granted


@pytest.mark.parametrize(("num_computed", "threshold", "cap"), [
    (0, 256, 256),
    (1792, 256, 256),  # context end 2048: still the whole threshold
    (4096 - 256, 256, 128),  # twice the context: half the chunk
    (8000 - 256, 256, 65),
    (200_000, 256, 16),  # never below the minimum chunk
    (200_000, 8, 8),  # nor above the threshold
    (0, 0, None),
])
def test_a_prefill_chunk_shrinks_as_its_context_grows(num_computed, threshold, cap):
    assert prefill_chunk_cap(num_computed, threshold) == cap


def test_a_long_prefill_leaves_the_budget_to_a_short_prompt_waiting_behind_it():
    long = _running("long", num_prompt_tokens=8000, num_computed_tokens=4000)
    short = make_request("short", num_prompt_tokens=30)
    assert _granted([long], [short]) == {"long": 2048 * 256 // 4256, "short": 30}


def test_without_a_threshold_the_long_prefill_takes_the_whole_budget():
    long = _running("long", num_prompt_tokens=8000, num_computed_tokens=4000)
    short = make_request("short", num_prompt_tokens=30)
    assert _granted([long], [short], threshold=0) == {"long": 2048}


def test_decodes_get_their_token_first_then_the_capped_chunk_then_the_waiting():
    decodes = [_decode(f"d{i}") for i in range(3)]
    long = _running("long", num_prompt_tokens=7000, num_computed_tokens=0)
    waiting = [make_request("w0", num_prompt_tokens=100), make_request("w1", num_prompt_tokens=2000)]
    granted = _granted([*decodes, long], waiting, token_budget=600)
    assert granted == {"d0": 1, "d1": 1, "d2": 1, "long": 256, "w0": 100, "w1": 600 - 3 - 256 - 100}


def test_a_new_long_prompt_starts_with_one_capped_chunk():
    long = make_request("long", num_prompt_tokens=7000)
    short = make_request("short", num_prompt_tokens=10)
    assert _granted([], [long, short]) == {"long": 256, "short": 10}


def test_a_short_budget_still_binds_below_the_threshold():
    long = _running("long", num_prompt_tokens=7000, num_computed_tokens=512)
    short = make_request("short", num_prompt_tokens=50)
    assert _granted([long], [short], token_budget=100) == {"long": 100}


def test_two_long_prompts_each_take_a_capped_chunk():
    first = _running("a", num_prompt_tokens=7000, num_computed_tokens=4096 - 256)
    second = _running("b", num_prompt_tokens=7000, num_computed_tokens=0)
    assert _granted([first, second], []) == {"a": 128, "b": 256}
