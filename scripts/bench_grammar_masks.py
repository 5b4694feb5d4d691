"""Per-step CPU cost of structured-output token masks at batch 64: xgrammar (what pagedserve uses),
llguidance and outlines-core, on the SmolLM2 tokenizer (49152 tokens) and one nested JSON schema.

Each of the 64 sequences replays the tokens of a different valid JSON document (what a model that
follows the schema writes), so the matchers sit in different states; a step fills all 64 mask
rows. Compile time is measured once, cold. llguidance and outlines-core are not pagedserve
dependencies: `pip install llguidance outlines-core` to compare.

    python3 scripts/bench_grammar_masks.py [xgrammar|llguidance|outlines-core ...]
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

import torch

from pagedserve.shared.tokenizer import load_tokenizer

BATCH, VOCAB, EOS = 64, 49152, 2
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}, "score": {"type": "number"}},
    "required": ["name", "age", "tags", "address"]}


def documents(n: int) -> list[str]:
    out = []
    for k in range(n):
        r = random.Random(k)
        d = {"name": r.choice(["Alice Smith", "Bob", "Chandra Patel", "Dmitri Ivanov", "Fatima Zahra"]),
             "age": r.randint(0, 120), "tags": r.sample(["a", "b", "c"], r.randint(0, 3)),
             "address": {"city": r.choice(["Paris", "New York", "Lagos", "Tokyo"]), "zip": f"{r.randint(0, 99999):05d}"}}
        if r.random() < .5:
            d["score"] = round(r.uniform(-100, 100), 3)
        out.append(json.dumps(d))  # ", " and ": ": the separators xgrammar's compact mode takes
    return out


def xgrammar_matchers(hf):
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=[EOS]),
                                   max_threads=1)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - started
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    bitmask = xgr.allocate_token_bitmask(BATCH, VOCAB)

    def fill():
        for i, m in enumerate(matchers):
            if not m.is_terminated():
                m.fill_next_token_bitmask(bitmask, i)

    return compile_s, fill, lambda i, t: matchers[i].accept_token(t)


def llguidance_matchers(hf):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=VOCAB, eos_token=EOS)
    grammar = llguidance.grammar_from("json_schema", json.dumps(SCHEMA))
    started = time.perf_counter()
    matchers = [llguidance.LLMatcher(tokenizer, grammar)]  # it compiles lazily, as the mask is asked
    compile_s = time.perf_counter() - started
    matchers += [llguidance.LLMatcher(tokenizer, grammar) for _ in range(BATCH - 1)]
    bitmask = llguidance.torch.allocate_token_bitmask(BATCH, VOCAB)
    executor = llguidance.LLExecutor(1)
    pairs = [(m, i) for i, m in enumerate(matchers)]
    return compile_s, lambda: llguidance.torch.fill_next_token_bitmask_par(executor, pairs, bitmask), \
        lambda i, t: matchers[i].consume_token(t)


def outlines_core_matchers(hf):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    by_text: dict[str, list[int]] = {}
    for token, token_id in hf.get_vocab().items():
        if token_id != EOS and (text := hf.convert_tokens_to_string([token])):
            by_text.setdefault(text, []).append(token_id)
    started = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(EOS, by_text))
    compile_s = time.perf_counter() - started
    guides = [Guide(index) for _ in range(BATCH)]
    bitmask = torch.zeros((BATCH, (VOCAB + 31) // 32), dtype=torch.int32)

    def fill():
        for i, g in enumerate(guides):
            g.write_mask_into(bitmask[i].data_ptr(), bitmask[i].numel(), bitmask.element_size())

    return compile_s, fill, lambda i, t: None if t == EOS else guides[i].advance(t)


LIBRARIES = {"xgrammar": xgrammar_matchers, "llguidance": llguidance_matchers, "outlines-core": outlines_core_matchers}


def main(names: list[str]) -> None:
    tokenizer = load_tokenizer("smollm2")
    sequences = [tokenizer.encode(d, add_special_tokens=False) + [EOS] for d in documents(BATCH)]
    for name in names:
        compile_s, fill, accept = LIBRARIES[name](tokenizer.hf)
        times = []
        for step in range(max(map(len, sequences))):
            started = time.perf_counter()
            fill()
            times.append(time.perf_counter() - started)
            for i, seq in enumerate(sequences):
                if step < len(seq):
                    accept(i, seq[step])
        times.sort()
        print(f"{name:14s} compile {compile_s * 1e3:7.1f} ms   mask fill, batch {BATCH}, {len(times)} steps: "
              f"median {statistics.median(times) * 1e3:.2f} ms  mean {statistics.mean(times) * 1e3:.2f} ms  "
              f"p90 {times[int(0.9 * len(times))] * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(LIBRARIES))
