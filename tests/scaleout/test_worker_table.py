"""The scheduler's table of workers (services/scheduler/workers.py) and migration
(handover.py), driven with the scheduler tests' doubles: placement by load, and a worker
that dies mid-generation hands its requests to a survivor, which finishes them with the
same tokens (the fake worker's tokens depend only on request and position)."""

from __future__ import annotations

from pagedserve.services.scheduler.placement import Router
from pagedserve.services.scheduler.policies.fcfs import FCFSPolicy
from pagedserve.services.scheduler.scheduler import Scheduler
from pagedserve.services.scheduler.workers import WorkerTable
from pagedserve.shared.block_hash import hash_full_blocks, root_hash
from pagedserve.shared.messages import WorkerHello
from tests.scheduler.fakes import CountingAllocator, FakeWorker, make_request, run_step
from tests.scheduler.outcomes import outputs_by_request

BS = 4


def table(mode: str = "prefix") -> WorkerTable:
    workers = WorkerTable(lambda: Scheduler(FCFSPolicy(), max_num_seqs=8, max_num_batched_tokens=64),
                          Router(mode))
    for worker_id in ("w1", "w2"):
        lane, deltas = workers.join(WorkerHello(worker_id, 64, BS, "m", 256), f"inc-{worker_id}", 1000)
        assert deltas == [] and lane.sched.max_model_len == 256
    return workers


def lane_of(workers: WorkerTable, request_id: str) -> str:
    (worker_id,) = [w for w, lane in workers.lanes.items()
                    if any(r.request_id == request_id for r in lane.sched.live_requests())]
    return worker_id


def test_a_burst_is_spread_by_load():
    workers = table()
    for i in range(8):  # distinct prompts (make_request's tokens depend on the id's length)
        assert workers.place(make_request("r" + "x" * i, num_prompt_tokens=8, max_tokens=4), fresh=True) == []
    assert sorted(len(lane.sched.live_requests()) for lane in workers.lanes.values()) == [4, 4]
    stats = workers.stats()
    assert stats["num_requests_waiting"] == 8 and set(stats["workers"]) == {"w1", "w2"}


def test_requests_wait_unplaced_until_a_worker_joins():
    workers = WorkerTable(lambda: Scheduler(FCFSPolicy()), Router())
    workers.model = WorkerHello("w0", 64, BS, "m", 256)
    workers.place(make_request("a", num_prompt_tokens=8), fresh=True)
    assert workers.stats()["num_requests_unplaced"] == 1 and workers.is_busy()
    workers.abort("a")
    assert workers.unplaced == []
    workers.place(make_request("b", num_prompt_tokens=8), fresh=True)
    lane, _ = workers.join(WorkerHello("w1", 64, BS, "m", 256), "inc", 1000)
    assert [r.request_id for r in lane.sched.live_requests()] == ["b"]


def test_a_dead_workers_requests_finish_on_the_survivor_with_the_same_tokens():
    prompts = {f"r{i}": make_request(f"r{i}", num_prompt_tokens=6 + i, max_tokens=10) for i in range(4)}
    expected = {}
    for request_id, request in prompts.items():  # each alone on one worker: the reference
        solo = Scheduler(FCFSPolicy(), max_num_batched_tokens=64)
        solo.add_request(make_request(request_id, num_prompt_tokens=request.num_prompt_tokens, max_tokens=10))
        allocator, worker = CountingAllocator(64, BS), FakeWorker(BS)
        records = [run_step(solo, allocator, worker) for _ in range(20) if solo.has_requests()]
        expected.update(outputs_by_request(records))
    workers = table()
    for request in prompts.values():
        workers.place(request, fresh=True)
    doubles = {w: (CountingAllocator(64, BS), FakeWorker(BS)) for w in workers.lanes}
    records = []
    for _ in range(2):  # a prefill and a few tokens each, then w1 dies
        for worker_id, lane in workers.lanes.items():
            records.append(run_step(lane.sched, *doubles[worker_id]))
    on_w1 = [r for r in prompts if lane_of(workers, r) == "w1"]
    assert on_w1 and all(prompts[r].num_output_tokens > 0 for r in on_w1)
    moved, deltas = workers.leave(workers.lanes["w1"])
    assert sorted(r.request_id for r in moved) == sorted(on_w1) and deltas == []
    assert list(workers.lanes) == ["w2"] and all(lane_of(workers, r) == "w2" for r in prompts)
    survivor = workers.lanes["w2"]
    while survivor.sched.has_requests():
        records.append(run_step(survivor.sched, *doubles["w2"]))
    assert outputs_by_request(records) == expected
    stats = workers.stats()
    assert stats["num_finished_total"] == 4  # the dead lane's counters are kept
    assert stats["num_preemptions_total"] == len(on_w1)  # its running requests were preempted
    doubles["w2"][0].check_integrity()


def test_load_counts_held_blocks_once_and_the_new_blocks_of_waiting_requests():
    workers = table()
    workers.lanes["w1"].held_blocks = 40  # e.g. 8 running requests sharing a 32-block prefix
    workers.place(make_request("a", num_prompt_tokens=8), fresh=True)  # 2 blocks, cached nowhere
    (worker_id,) = [w for w, lane in workers.lanes.items() if lane.sched.live_requests()]
    assert worker_id == "w2"
    assert workers.lanes["w2"].load_blocks() == 2 and workers.lanes["w1"].load_blocks() == 40


def test_placement_hashes_a_request_once_and_its_candidates_carry_the_hashes():
    """Placement hashes the request's known tokens (root: model and salt) and keeps the hashes on
    it: its first candidate gives them to the kvstore, which then hashes nothing."""
    workers = table()
    request = make_request("h", num_prompt_tokens=10, max_tokens=2)
    request.cache_salt = "s"
    workers.place(request, fresh=True)
    expected = hash_full_blocks(request.prompt_token_ids, BS, root_hash(("m", "s")))
    assert request.block_hashes.hashes == expected and len(expected) == 2
    lane = workers.lanes[lane_of(workers, "h")]
    (candidate,) = lane.sched.schedule().candidates
    assert candidate.block_hashes == expected and candidate.token_ids == request.prompt_token_ids
