"""Random interleavings of steps, forks, frees, aborts and cache resets against a model of
what a worker writes.

The model plays scheduler and worker: it offers running and waiting requests in random
order (running ones with or without the tokens their step computes), forks running
requests into children, then applies the reply's copy-on-write pairs and "writes" each
granted token into a shadow of the pool (block id -> token per slot). Checked after every
rule: the pool's own integrity; every block a request holds for its computed positions
still holds that request's tokens (nobody else wrote into it: a shared block is full, a
shared partial one is copied before a fork writes it); every prefix-cache hit reads
exactly the admitted request's tokens; the hash table maps each hash only to a block
whose shadow holds the tokens of that hash; the reply obeys the step's rules (results in
order, only a tail of the running candidates preempted, admission stops at the first
refusal or at a preemption no admitted waiting candidate before it may have made (a waiting
candidate displaces the running ones after it), a fork's first grant lists its whole table). At the end, after
freeing everything, every block is free again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.services.kvstore.block_manager import BlockManager
from pagedserve.services.kvstore.block_table import num_blocks_for
from pagedserve.shared.block_hash import hash_full_blocks
from pagedserve.shared.messages import ALLOC_NOT_ADMITTED, ALLOC_OK, ALLOC_PREEMPTED, AllocCandidate, AllocRequest, Fork

# few distinct tokens and a shared stem, so prompts often share prefixes
token_lists = st.lists(st.integers(0, 2), min_size=1, max_size=20)
STEM = [0, 1, 2, 0, 1, 2, 0, 1]


@dataclass
class ModelRequest:
    token_ids: list[int]
    num_computed_tokens: int = 0  # slots the kvstore covers for it
    num_cached_tokens: list[int] = field(default_factory=list)


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 4]),
                prefix=st.sampled_from([True, True, False]), watermark=st.sampled_from([0.0, 0.1, 0.5]))
    def setup(self, num_blocks, block_size, prefix, watermark):
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix, watermark=watermark)
        self.block_size = block_size
        self.running: dict[str, ModelRequest] = {}
        self.waiting: dict[str, ModelRequest] = {}
        self.finished: list[str] = []  # freed by the next step, they hold blocks until then
        self.holding: dict[str, ModelRequest] = {}  # finished, not yet freed
        self.shadow: dict[int, list[int | None]] = {}
        self.hash_tokens: dict[bytes, list[int]] = {}  # every hash a known prefix gives -> its last block
        self.fresh_forks: set[str] = set()  # forked, not granted yet
        self.prompts: list[list[int]] = []
        self.next_id = 0
        self.step_id = 0

    @rule(token_ids=token_lists, with_stem=st.booleans())
    def add_request(self, token_ids, with_stem):
        self._add((STEM if with_stem else []) + token_ids)

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), suffix=st.lists(st.integers(0, 2), max_size=6))
    def add_request_sharing_a_prefix(self, data, suffix):
        """A part of an earlier prompt, plus a suffix: prefix hits, misses past it."""
        earlier = data.draw(st.sampled_from(self.prompts))
        self._add(earlier[: data.draw(st.integers(1, len(earlier)))] + suffix)

    def _add(self, token_ids):
        self._remember_hashes(token_ids)
        self.prompts.append(token_ids)
        self.waiting[f"r{self.next_id}"] = ModelRequest(list(token_ids))
        self.next_id += 1

    @rule(data=st.data())
    def run_step_offering_everyone(self, data):
        """Every running and waiting request in a random order: the pool fills up soon."""
        ids = list(self.running) + list(self.waiting)
        self._run_step(data, data.draw(st.permutations(ids)) if ids else [])

    @rule(data=st.data())
    def run_step_offering_some(self, data):
        ids = list(self.running) + list(self.waiting)
        chosen = data.draw(st.permutations(ids)) if ids else []
        self._run_step(data, chosen[: data.draw(st.integers(0, len(chosen)))])

    @precondition(lambda self: self.running)
    @rule(data=st.data(), num_children=st.integers(1, 3))
    def fork(self, data, num_children):
        """Fork a running request into children, then run a step offering some of them."""
        parent_id = data.draw(st.sampled_from(sorted(self.running)))
        parent = self.running.pop(parent_id)
        child_ids = [f"{parent_id}.{i}.{self.next_id}" for i in range(num_children)]
        self.next_id += 1
        for child_id in child_ids:
            self.running[child_id] = ModelRequest(list(parent.token_ids), parent.num_computed_tokens)
        self.fresh_forks.update(child_ids)
        chosen = data.draw(st.permutations(list(self.running) + list(self.waiting)))
        self._run_step(data, chosen[: data.draw(st.integers(0, len(chosen)))], [Fork(parent_id, child_ids)])

    @rule()
    def reset_prefix_cache(self):
        self.manager.reset_prefix_cache()

    def _remember_hashes(self, token_ids):
        for index, block_hash in enumerate(hash_full_blocks(token_ids, self.block_size)):
            self.hash_tokens[block_hash] = token_ids[index * self.block_size:(index + 1) * self.block_size]

    def _run_step(self, data, chosen, forks=()):
        candidates = []
        for request_id in chosen:
            if request_id in self.running:
                request = self.running[request_id]
                num_new = data.draw(st.integers(0, 2 * self.block_size + 1))
                missing = max(0, request.num_computed_tokens + num_new - len(request.token_ids))
                request.token_ids += data.draw(st.lists(st.integers(0, 2), min_size=missing, max_size=missing))
                self._remember_hashes(request.token_ids)
                start = request.num_computed_tokens
                told = request.token_ids[start:start + num_new] if data.draw(st.booleans()) else []
                candidates.append(AllocCandidate(request_id, num_new, len(request.token_ids), token_ids=told))
            else:
                request = self.waiting[request_id]
                num_new = data.draw(st.integers(1, len(request.token_ids)))
                candidates.append(AllocCandidate(request_id, num_new, len(request.token_ids), True,
                                                 list(request.token_ids)))
        before = {c.request_id: self.manager.get_block_ids(c.request_id) for c in candidates}
        free_ids, self.finished = self.finished, []
        reply = self.manager.step(AllocRequest(self.step_id, free_ids, candidates, list(forks)))
        self.step_id += 1
        for request_id in free_ids:
            del self.holding[request_id]
        copies = {dst: list(self.shadow.get(src, [None] * self.block_size)) for src, dst in reply.block_copies}
        self.shadow.update(copies)  # the worker copies before it computes anything
        self._check_reply(reply, candidates, before)

    def _check_reply(self, reply, candidates, before):
        assert [r.request_id for r in reply.results] == [c.request_id for c in candidates]
        assert (reply.num_free_blocks, reply.num_blocks) == (self.manager.num_free_blocks, self.manager.num_blocks)
        pairs = list(zip(reply.results, candidates, strict=True))
        preempted = [r.status == ALLOC_PREEMPTED for r, c in pairs if not c.is_waiting]
        assert preempted == sorted(preempted), "only a tail of the running candidates is preempted"
        admitting = True
        displacing = False  # an admitted waiting candidate may have preempted those after it
        for result, candidate in pairs:
            request_id = candidate.request_id
            was_fresh = request_id in self.fresh_forks
            if result.status != ALLOC_OK or candidate.num_new_tokens:  # a fork stays fresh until it writes
                self.fresh_forks.discard(request_id)
            if result.status == ALLOC_PREEMPTED:
                assert not candidate.is_waiting and not self.manager.has_request(request_id)
                admitting = admitting and displacing
                request = self.running.pop(request_id)
                request.num_computed_tokens = 0
                self.waiting[request_id] = request
            elif result.status == ALLOC_NOT_ADMITTED:
                assert candidate.is_waiting and not self.manager.has_request(request_id)
                admitting = False
            elif candidate.is_waiting:
                assert result.status == ALLOC_OK and admitting
                displacing = True
                request = self.waiting.pop(request_id)
                self.running[request_id] = request
                num_cached = result.num_cached_tokens
                assert num_cached % self.block_size == 0 and 0 <= num_cached < len(request.token_ids)
                assert num_cached == 0 or self.manager.enable_prefix_caching
                assert self.manager.get_block_ids(request_id) == result.new_block_ids
                request.num_computed_tokens = num_cached
                self._check_written(request_id, request, "a prefix hit")
                num_new = min(candidate.num_new_tokens, len(request.token_ids) - num_cached)
                self._write(request_id, request, num_new)
            else:
                assert result.status == ALLOC_OK
                request = self.running[request_id]
                if was_fresh:  # the worker never saw it: the whole table
                    assert self.manager.get_block_ids(request_id) == result.new_block_ids
                else:
                    assert self.manager.get_block_ids(request_id) == before[request_id] + result.new_block_ids
                self._write(request_id, request, candidate.num_new_tokens)

    def _write(self, request_id, request, num_new):
        """The worker computes positions [computed, computed + num_new) into the table."""
        block_ids = self.manager.get_block_ids(request_id)
        assert len(block_ids) == num_blocks_for(request.num_computed_tokens + num_new, self.block_size)
        for position in range(request.num_computed_tokens, request.num_computed_tokens + num_new):
            block_id, slot = divmod(position, self.block_size)
            self.shadow.setdefault(block_ids[block_id], [None] * self.block_size)[slot] = request.token_ids[position]
        request.num_computed_tokens += num_new

    def _check_written(self, request_id, request, what):
        block_ids = self.manager.get_block_ids(request_id)
        for position in range(request.num_computed_tokens):
            block_id, slot = divmod(position, self.block_size)
            written = self.shadow.get(block_ids[block_id], [None] * self.block_size)[slot]
            assert written == request.token_ids[position], (
                f"{what}: {request_id} position {position} in block {block_ids[block_id]} holds {written}")

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.running)))
        self.fresh_forks.discard(request_id)
        self.holding[request_id] = self.running.pop(request_id)
        self.finished.append(request_id)

    @rule(data=st.data())
    def abort_now(self, data):
        """An abort through the fine-grained API: running, waiting or unknown alike."""
        request_id = data.draw(st.sampled_from(sorted(self.running) + sorted(self.waiting) + ["ghost"]))
        self.manager.free(request_id)
        self.running.pop(request_id, None)
        self.waiting.pop(request_id, None)
        self.fresh_forks.discard(request_id)

    @invariant()
    def pool_is_consistent(self):
        self.manager.check_integrity()
        holders = {**self.running, **self.holding}
        held = set()
        for request_id, request in holders.items():
            self._check_written(request_id, request, "a held block was overwritten")
            held.update(self.manager.get_block_ids(request_id))
        for request_id in self.waiting:
            assert not self.manager.has_request(request_id)
        assert self.manager.num_held_blocks == len(held)
        for block_hash, block in self.manager.pool.cached_blocks.items():
            assert self.shadow.get(block.block_id) == self.hash_tokens[block_hash], (
                f"the hash table maps a prefix to block {block.block_id}, which holds other tokens")

    def teardown(self):
        if not hasattr(self, "manager"):
            return
        every_id = list(self.running) + list(self.waiting) + self.finished
        reply = self.manager.step(AllocRequest(self.step_id, every_id, []))
        self.manager.check_integrity()
        assert reply.num_free_blocks == self.manager.num_blocks == self.manager.num_free_blocks


BlockManagerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
