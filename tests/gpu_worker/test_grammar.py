"""The worker's grammar state without the model: a matcher rebuilt by replaying a sequence's tokens
masks exactly as the one that followed it step by step; a finished grammar allows only EOS and then
leaves its row alone; the mask sets every forbidden logit to -inf and nothing else."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.services.gpu_worker.sampling.grammar import Grammars, apply_bitmask
from pagedserve.shared.messages import GuidedDecoding

EOS, VOCAB = 2, 49152
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}


@pytest.fixture(scope="module", params=[True, False], ids=["beside-the-forward", "on-the-step-thread"])
def grammars(request):
    return Grammars("smollm2", VOCAB, [EOS], overlap=request.param)


def _mask(grammars, sequences):
    bitmask, rows = grammars.start_masks(sequences).result()
    logits = apply_bitmask(torch.zeros(len(sequences), VOCAB), bitmask, rows)
    return bitmask, rows, logits


def test_a_replayed_matcher_masks_as_the_one_that_followed(grammars, tokenizer):
    guide = GuidedDecoding("json", json.dumps(SCHEMA))
    tokens = tokenizer.encode('{"n": 7}', add_special_tokens=False)
    followed = grammars.sequence(guide, [])
    for k, token in enumerate(tokens):
        replayed = grammars.sequence(guide, tokens[:k])  # seen anew after k tokens (preempted, migrated)
        a, rows, logits = _mask(grammars, [followed, replayed, None])
        assert rows == [0, 1] and torch.equal(a[0], a[1])
        allowed = (logits[0] == 0).nonzero().flatten().tolist()
        assert token in allowed and (logits[2] == 0).all()  # the unconstrained row is untouched
        assert set(torch.unique(logits[0]).tolist()) <= {0.0, float("-inf")}
        followed.accept(token)
    _, _, logits = _mask(grammars, [followed])
    assert (logits[0] == 0).nonzero().flatten().tolist() == [EOS]  # complete: only the end
    followed.accept(EOS)
    _, rows, logits = _mask(grammars, [followed])
    assert rows == [] and (logits == 0).all()  # ended: a token sampled past the end is not masked


def test_each_spec_compiles_once_and_choices_get_their_own_matchers(grammars):
    guide = GuidedDecoding("regex", "ab+")
    first, second = grammars.sequence(guide, []), grammars.sequence(guide, [])
    assert first._compiled is second._compiled and first.matcher() is not second.matcher()


def test_a_failing_grammar_leaves_its_row_unconstrained(grammars):
    broken = grammars.sequence(GuidedDecoding("regex", "a("), [])  # the api refuses it; the worker survives it
    good = grammars.sequence(GuidedDecoding("regex", "a"), [])
    _, rows, logits = _mask(grammars, [broken, good])
    assert rows == [1] and (logits[0] == 0).all() and (logits[1] == 0).sum() == 1


def test_prefetched_grammars_are_reported_once_compiled_or_failed(grammars):
    good, broken = GuidedDecoding("regex", "c[0-9]{3}"), GuidedDecoding("regex", "b(")
    grammars.prefetch([good, broken])
    reported = grammars.take_compiled(wait_s=30.0)
    while len(reported) < 2:
        reported += grammars.take_compiled(wait_s=30.0)
    assert sorted(reported) == sorted([good.key, broken.key]) and grammars.take_compiled() == []
    assert grammars.sequence(good, [])._compiled.done()  # the sequence finds it compiled: no step waits
    grammars.prefetch([good])  # cached: reported at once
    assert grammars.take_compiled() == [good.key]
