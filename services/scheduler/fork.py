"""Parallel sampling (n > 1) in the scheduler: one prefill, then n children share its blocks.

A fork parent (sampling.n > 1) computes up to its last prompt token and never samples. Its
children (shared/parallel_sampling.py) are held here until that prefill is done; fork() then
puts them in its running place, the next AllocRequest carries the Fork (the kvstore shares
the parent's blocks, copy-on-write), and each child computes the last prompt token and samples.
Invariants: a held child is WAITING, nothing computed, in the request table but no queue; a
parent with no live child left is aborted.
"""

from __future__ import annotations

from services.scheduler.request import Request, RequestStatus
from shared.messages import Fork
from shared.parallel_sampling import child_request_ids, child_sampling


class ForkGroups:
    def __init__(self) -> None:
        self._children: dict[str, list[Request]] = {}  # parent id -> its held children
        self._parent_of: dict[str, str] = {}  # held child id -> parent id
        self._forks: list[Fork] = []  # made since the last AllocRequest

    def make_children(self, parent: Request) -> list[Request]:
        """The n children of a fork parent, held until fork(); the caller registers them."""
        children = []
        for index, child_id in enumerate(child_request_ids(parent.request_id, parent.sampling.n)):
            child = Request(child_id, parent.prompt_token_ids, child_sampling(parent.sampling, index),
                            parent.eos_token_ids, parent.arrival_time, parent.priority, parent.tenant,
                            parent.cache_salt)
            child.arrival_seq = parent.arrival_seq
            children.append(child)
            self._parent_of[child_id] = parent.request_id
        self._children[parent.request_id] = children
        return children

    def parent_of(self, request_id: str) -> str | None:
        """The parent of a held child, else None."""
        return self._parent_of.get(request_id)

    def release_child(self, child: Request) -> bool:
        """Forget a held child (aborted); True if its parent has no child left."""
        parent_id = self._parent_of.pop(child.request_id)
        children = self._children[parent_id]
        children.remove(child)
        return not children

    def drop(self, parent_id: str) -> list[Request]:
        """Forget a parent (aborted): its held children, for the caller to abort."""
        children = self._children.pop(parent_id, [])
        for child in children:
            del self._parent_of[child.request_id]
        return children

    def is_ready(self, request: Request) -> bool:
        """A running parent whose prefill is done: fork it now."""
        return request.is_fork_parent and request.num_computed_tokens >= request.num_tokens_to_compute

    def fork(self, parent: Request) -> list[Request]:
        """The parent's live children, RUNNING from where it stopped; the caller replaces the parent."""
        children = self.drop(parent.request_id)
        for child in children:
            child.status = RequestStatus.RUNNING
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_kv_known_tokens = parent.num_kv_known_tokens  # its table is the parent's
            child.is_fresh_fork = True
        self._forks.append(Fork(parent.request_id, [c.request_id for c in children]))
        return children

    def take_forks(self) -> list[Fork]:
        forks, self._forks = self._forks, []
        return forks

    def forget_forks(self) -> None:
        """The kvstore is being reset: the parents' tables a Fork would split are gone."""
        self._forks = []
