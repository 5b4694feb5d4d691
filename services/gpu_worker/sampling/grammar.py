"""Structured outputs on the worker (xgrammar): one matcher per sequence, a token bitmask per step.

Grammars compile on their own thread the moment a plan names them, once per (kind, spec) (cached),
so a new schema never runs on the step's thread; the scheduler asks for them ahead (prefetch) and
holds their requests until a result reports them compiled, so no step waits for one. On a
GPU a step's masks are filled on another thread while the model's forward runs (on a CPU, after the
forward), and the sampler joins them (sampler.sample; on a CPU its kernel races only over the allowed
tokens). A matcher is state that never travels: a sequence seen anew (new, resumed after a
preemption, migrated to this worker, a fork's child) gets a fresh one that replays the tokens it
generated so far. Once a grammar is complete only the stop tokens (the model's EOS) are allowed, so
the request ends there as any other.
"""

from __future__ import annotations

import collections
import functools
import logging
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.shared.messages import GuidedDecoding

log = logging.getLogger("pagedserve.worker")

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (least recently asked dropped first)


def compile_guided(compiler, guided: GuidedDecoding):
    """xgrammar.GrammarCompiler + what the api validated -> a CompiledGrammar."""
    if guided.kind == "json":
        return compiler.compile_json_schema(guided.spec, any_whitespace=False)
    if guided.kind == "json_object":  # any object (not any JSON value), with any properties
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if guided.kind == "regex":
        return compiler.compile_regex(guided.spec)
    if guided.kind == "grammar":
        return compiler.compile_grammar(guided.spec)
    if guided.kind == "structural_tag":  # free text with constrained tagged regions (tools/strict)
        return compiler.compile_structural_tag(guided.spec)
    raise ValueError(f"unknown structured output kind {guided.kind!r}")


class SequenceGrammar:
    """One sequence's matcher; built on first use from its compiled grammar, replaying the output so far."""

    def __init__(self, compiled: Future, output_token_ids: list[int]):
        self._compiled = compiled
        self._pending = list(output_token_ids)  # accepted before the matcher exists
        self._matcher = None

    def matcher(self):
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self._compiled.result())
            for token_id in self._pending:
                self.accept(token_id)
            self._pending = []
        return self._matcher

    def accept(self, token_id: int) -> None:
        """After sampling. A finished grammar takes nothing more (a token sampled past the end, with
        asynchronous scheduling, is dropped by the scheduler anyway)."""
        if self._matcher is None:
            self._pending.append(token_id)
        elif not self._matcher.is_terminated() and not self._matcher.accept_token(token_id):
            log.warning("grammar rejected token %d", token_id)

    def live_matcher(self):
        """The matcher, None once the grammar has ended (its row is left unconstrained)."""
        matcher = self.matcher()
        return None if matcher.is_terminated() else matcher


class Grammars:
    """The worker's compiler, its cache of compiled grammars and the two threads they run on."""

    def __init__(self, model: str, vocab_size: int, stop_token_ids: list[int], overlap: bool = True):
        self.model, self.vocab_size, self.stop_token_ids = model, vocab_size, list(stop_token_ids)
        # masks beside the forward on a GPU; on a CPU the forward already keeps every core busy, and a
        # third thread there only preempts its OpenMP threads: the step thread fills them after it
        self.overlap = overlap
        self._compile_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._compiler: Future | None = None
        self._compiled: collections.OrderedDict[tuple[str, str], Future] = collections.OrderedDict()
        self.watched: dict[str, Future] = {}  # prefetched, by key, until take_compiled reports them

    def _make_compiler(self):
        import xgrammar as xgr

        from pagedserve.shared.tokenizer import load_tokenizer

        info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(self.model).hf, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_token_ids)
        return xgr.GrammarCompiler(info, max_threads=1)

    def _compile(self, guided: GuidedDecoding):
        return compile_guided(self._compiler.result(), guided)

    def sequence(self, guided: GuidedDecoding, output_token_ids: list[int]) -> SequenceGrammar:
        """A new sequence's grammar; compiling starts now unless this spec was compiled before."""
        return SequenceGrammar(self._future(guided), output_token_ids)

    def prefetch(self, specs: list[GuidedDecoding]) -> None:
        """Start compiling grammars a plan names ahead of their requests (StepPlan.compile_grammars)."""
        for guided in specs:
            self.watched[guided.key] = self._future(guided)

    def take_compiled(self, wait_s: float = 0.0) -> list[str]:
        """Keys of prefetched grammars whose compile ended (ok or not) since the last call; wait_s: how
        long to wait for one when none has yet."""
        if wait_s > 0 and self.watched and not any(f.done() for f in self.watched.values()):
            wait(list(self.watched.values()), timeout=wait_s, return_when=FIRST_COMPLETED)
        done = [key for key, f in self.watched.items() if f.done()]
        for key in done:
            del self.watched[key]
        return done

    def _future(self, guided: GuidedDecoding) -> Future:
        if self._compiler is None:
            self._compiler = self._compile_thread.submit(self._make_compiler)
        key = (guided.kind, guided.spec)
        compiled = self._compiled.get(key)
        if compiled is None or (compiled.done() and compiled.exception() is not None):
            compiled = self._compiled[key] = self._compile_thread.submit(self._compile, guided)
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return compiled

    def start_masks(self, grammars: list[SequenceGrammar | None]) -> Future | _Deferred | None:
        """The bitmask [rows, ceil(V/32)] int32 of a step's sampling rows (None where unconstrained),
        filled on the mask thread (overlap) or when asked for; its result() is (bitmask, constrained
        row indices), which the sampler applies (sampler.sample). None: no row is constrained."""
        if all(g is None for g in grammars):
            return None
        if not self.overlap:
            return _Deferred(grammars, self.vocab_size)
        return self._mask_thread.submit(_fill, grammars, self.vocab_size)


class _Deferred:
    """A step's masks filled on the step thread, the first time they are asked for."""

    def __init__(self, grammars: list[SequenceGrammar | None], vocab_size: int):
        self._args, self._result = (grammars, vocab_size), None

    def result(self) -> tuple[torch.Tensor, list[int]]:
        if self._result is None:
            self._result = _fill(*self._args)
        return self._result


@functools.cache
def _batch_matcher():
    """xgrammar's batch fill: every row in one call, on up to 8 threads (half the cores torch uses: on a
    CPU worker the masks are filled after the forward, when its threads are idle)."""
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(max(1, min(8, torch.get_num_threads() // 2)))


def _fill(grammars: list[SequenceGrammar | None], vocab_size: int) -> tuple[torch.Tensor, list[int]]:
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab_size)
    rows, matchers = [], []
    for i, g in enumerate(grammars):
        try:
            matcher = g.live_matcher() if g is not None else None
        except Exception as e:  # one bad grammar must not fail the step of every other request
            log.error("grammar mask failed, row %d samples unconstrained: %s: %s", i, type(e).__name__, e)
            continue
        if matcher is not None:
            rows.append(i)
            matchers.append(matcher)
    if matchers:
        _batch_matcher().batch_fill_next_token_bitmask(matchers, bitmask, rows)
    return bitmask, rows


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits [N, V] float32 with every token row i's grammar forbids at -inf, for i in rows (in place)."""
    if not rows:
        return logits
    on_cpu = logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(1) == 1
    kernel = cpu_extensions.load("sample") if on_cpu else None
    if kernel is not None:
        kernel.mask_rows(logits, bitmask, torch.tensor(rows, dtype=torch.int64))
        return logits
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=logits.shape[1], indices=rows)
    return logits
