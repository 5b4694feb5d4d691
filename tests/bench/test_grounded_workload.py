"""The input-grounded named workload (grounded-edits-16): chats quoting code and prose, the same token
ids on every load, and an answer that starts quoting its input gets n-gram drafts."""

from __future__ import annotations

import json

from pagedserve.services.bench.grounded_workload import CODE, NUM_OUTPUT_TOKENS, TEXTS, grounded_chats
from pagedserve.services.bench.workloads import load_workload
from pagedserve.services.scheduler.ngram_proposer import propose_ngram


def test_sixteen_chats_each_holding_its_input(tokenizer):
    requests = load_workload("grounded-edits-16")
    assert len(requests) == 16 and {r.max_tokens for r in requests} == {NUM_OUTPUT_TOKENS}
    assert {r.ignore_eos for r in requests} == {False}  # answers end at EOS: what follows quotes nothing
    assert [r.prompt_token_ids for r in requests] == [r.prompt_token_ids for r in load_workload("grounded-edits-16")]
    texts = [tokenizer.decode(r.prompt_token_ids) for r in requests]
    inputs = CODE + CODE + TEXTS + TEXTS
    assert all(source.strip() in text for source, text in zip(inputs, texts, strict=True))
    assert [chat[0]["role"] for chat in grounded_chats()] == ["user"] * 16


def test_an_answer_quoting_its_input_gets_the_next_input_tokens_as_drafts(tokenizer):
    prompt = load_workload("grounded-edits-16")[0].prompt_token_ids
    quoted = tokenizer.encode(CODE[0], add_special_tokens=False)
    context = prompt + quoted[:6]
    drafts = propose_ngram(context, 2, 4, 4)
    assert drafts == quoted[6:10]


def test_a_workload_file_may_let_its_requests_end_at_eos(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps([{"prompt_token_ids": [5, 6], "max_tokens": 3},
                                {"prompt_token_ids": [7], "max_tokens": 2, "ignore_eos": False}]))
    assert [(r.prompt_token_ids, r.max_tokens, r.ignore_eos) for r in load_workload(str(path))] == [
        ([5, 6], 3, True), ([7], 2, False)]
