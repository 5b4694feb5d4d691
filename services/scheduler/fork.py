"""Parallel sampling (n > 1): the parent prefills all but its last prompt token, then n children share
its blocks copy-on-write. A held child is WAITING, in the request table but no queue; a parent with no
live child left is aborted.
"""

from __future__ import annotations

from pagedserve.services.scheduler.request import Request, RequestStatus
from pagedserve.shared.block_hash import BlockHashes
from pagedserve.shared.messages import Fork
from pagedserve.shared.parallel_sampling import child_request_ids, child_sampling


class ForkGroups:
    def __init__(self) -> None:
        self._children: dict[str, list[Request]] = {}  # parent id -> its held children
        self._parent_of: dict[str, str] = {}  # held child id -> parent id
        self.forks: list[Fork] = []

    def make_children(self, parent: Request) -> list[Request]:
        children = []
        for index, child_id in enumerate(child_request_ids(parent.request_id, parent.sampling.n)):
            child = Request(child_id, parent.prompt_token_ids, child_sampling(parent.sampling, index),
                            parent.eos_token_ids, parent.arrival_time, parent.priority, parent.tenant,
                            parent.cache_salt)
            child.arrival_seq = parent.arrival_seq
            if parent.block_hashes is not None:  # the prompt's, hashed once; each child extends its own
                hashes = parent.block_hashes
                child.block_hashes = BlockHashes(hashes.root, hashes.block_size, list(hashes.hashes))
            children.append(child)
            self._parent_of[child_id] = parent.request_id
        self._children[parent.request_id] = children
        return children

    def parent_of(self, request_id: str) -> str | None:
        return self._parent_of.get(request_id)

    def release_child(self, child: Request) -> bool:
        """Forget a held child (aborted); True if its parent has no child left."""
        parent_id = self._parent_of.pop(child.request_id)
        children = self._children[parent_id]
        children.remove(child)
        return not children

    def drop(self, parent_id: str) -> list[Request]:
        children = self._children.pop(parent_id, [])
        for child in children:
            del self._parent_of[child.request_id]
        return children

    def is_ready(self, request: Request) -> bool:
        return request.is_fork_parent and request.num_computed_tokens >= request.num_tokens_to_compute

    def fork(self, parent: Request) -> list[Request]:
        """The parent's live children, RUNNING from where it stopped."""
        children = self.drop(parent.request_id)
        for child in children:
            child.status = RequestStatus.RUNNING
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_kv_known_tokens = parent.num_kv_known_tokens  # its table is the parent's
            child.is_fresh_fork = True
        self.forks.append(Fork(parent.request_id, [c.request_id for c in children]))
        return children

    def take_forks(self) -> list[Fork]:
        forks, self.forks = self.forks, []
        return forks

    def forget_forks(self) -> None:
        self.forks = []
