"""serve-64 has vllm bench serve's random shape: 64 prompts of 256 tokens, 128 out, eos ignored."""

from pagedserve.services.bench.named_workloads import VOCAB
from pagedserve.services.bench.workloads import load_workload


def test_serve_64_shape():
    requests = load_workload("serve-64")
    assert len(requests) == 64
    assert {len(r.prompt_token_ids) for r in requests} == {256}
    assert {r.max_tokens for r in requests} == {128}
    assert all(r.ignore_eos for r in requests)
    assert all(100 <= t < VOCAB - 100 for r in requests for t in r.prompt_token_ids)
    assert len({tuple(r.prompt_token_ids) for r in requests}) == 64  # no shared prefixes: a cold run
    assert load_workload("serve-64")[5].prompt_token_ids == requests[5].prompt_token_ids  # seeded
