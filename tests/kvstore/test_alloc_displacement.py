"""The alloc step is the only code that preempts: a waiting candidate short of a seat or of blocks
takes the running candidates after it, tail first; a dry pool stops admission; nobody after: refused."""

from tests.kvstore.factories import (
    NOT_ADMITTED,
    OK,
    PREEMPTED,
    full_pool_of_three,
    make_manager,
    running,
    statuses,
    step,
    waiting,
)


def test_a_waiting_candidate_without_a_seat_takes_the_last_running_one_after_it():
    manager = make_manager(num_blocks=8, block_size=4)
    manager.allocate_slots("a", 8)
    manager.allocate_slots("b", 8)
    reply = step(manager, running("a", 0), waiting("w", 4), running("b", 0), num_free_seqs=0)
    assert statuses(reply) == [("a", OK, []), ("w", OK, [4]), ("b", PREEMPTED, [])]
    assert not manager.has_request("b") and manager.num_free_blocks == 5
    assert manager.num_preemptions == 1


def test_a_waiting_candidate_short_of_blocks_takes_the_tail_until_it_fits():
    manager = full_pool_of_three()
    reply = step(manager, waiting("w", 12), running("a", 0), running("b", 0), running("c", 0))
    assert statuses(reply) == [("w", OK, [5, 4, 3]), ("a", OK, []), ("b", PREEMPTED, []), ("c", PREEMPTED, [])]
    assert manager.get_block_ids("a") == [0, 1] and manager.num_free_blocks == 1


def test_a_waiting_candidate_with_nobody_after_it_is_refused_and_stops_admission():
    manager = full_pool_of_three()
    reply = step(manager, running("a", 0), running("b", 0), waiting("w", 4), waiting("x", 1), running("c", 0),
                 num_free_seqs=0)
    # w takes c's seat and blocks; x finds no seat and nobody left after it
    assert statuses(reply) == [("a", OK, []), ("b", OK, []), ("w", OK, [5]), ("x", NOT_ADMITTED, []),
                               ("c", PREEMPTED, [])]
    manager = full_pool_of_three()
    reply = step(manager, running("a", 0), running("b", 0), running("c", 0), waiting("w", 4))
    assert statuses(reply) == [("a", OK, []), ("b", OK, []), ("c", OK, []), ("w", NOT_ADMITTED, [])]
    assert manager.num_preemptions == 0


def test_each_of_two_waiting_candidates_takes_its_own_seat_or_victim():
    manager = make_manager(num_blocks=8, block_size=4)
    manager.allocate_slots("a", 4)
    reply = step(manager, waiting("w1", 4), waiting("w2", 4), running("a", 0), num_free_seqs=1)
    assert statuses(reply) == [("w1", OK, [1]), ("w2", OK, [2]), ("a", PREEMPTED, [])]


def test_a_dry_pool_before_a_waiting_candidate_stops_admission_though_it_could_displace():
    manager = full_pool_of_three()
    reply = step(manager, running("a", 4), waiting("w", 4), running("b", 0), running("c", 0))
    assert statuses(reply) == [("a", OK, [5]), ("w", NOT_ADMITTED, []), ("b", OK, []), ("c", PREEMPTED, [])]


def test_a_running_candidate_after_an_admitted_one_gives_up_its_own_blocks_when_the_pool_is_dry():
    manager = make_manager(num_blocks=3, block_size=4)
    manager.allocate_slots("a", 4)
    reply = step(manager, waiting("w", 8), running("a", 4))
    assert statuses(reply) == [("w", OK, [1, 2]), ("a", PREEMPTED, [])]
