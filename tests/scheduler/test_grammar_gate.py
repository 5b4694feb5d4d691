"""Compile before schedule: a structured-output request is held until its worker reports its grammar
compiled; the plan names each grammar once; a lost report only delays (GRAMMAR_WAIT_S); a lost
worker is asked again. Other requests run meanwhile."""

from __future__ import annotations

from pagedserve.services.scheduler import grammar_gate
from pagedserve.services.scheduler.grammar_gate import GrammarGate
from pagedserve.shared.messages import GuidedDecoding, StepResult
from tests.scheduler.fakes import make_request, make_stack, run_step

SCHEMA = GuidedDecoding("json", '{"type": "object"}')
REGEX = GuidedDecoding("regex", "a+")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_grammar_is_asked_once_and_holds_until_compiled():
    gate = GrammarGate(Clock())
    assert not gate.holds(SCHEMA) and not gate.holds(None)
    gate.want(SCHEMA)
    gate.want(SCHEMA)
    assert gate.holds(SCHEMA) and not gate.holds(REGEX)
    assert gate.take_asks() == [SCHEMA] and gate.take_asks() == []
    assert gate.holds(SCHEMA)
    gate.compiled([SCHEMA.key])
    assert not gate.holds(SCHEMA)
    gate.want(SCHEMA)  # known compiled: nothing to ask
    assert gate.take_asks() == [] and not gate.holds(SCHEMA)


def test_a_grammar_never_reported_is_let_through_after_the_wait():
    clock = Clock()
    gate = GrammarGate(clock)
    gate.want(SCHEMA)
    gate.take_asks()
    clock.now = grammar_gate.GRAMMAR_WAIT_S - 0.01
    assert gate.holds(SCHEMA)
    clock.now = grammar_gate.GRAMMAR_WAIT_S
    assert not gate.holds(SCHEMA) and not gate.holds(SCHEMA)


def test_a_lost_worker_is_asked_again_for_every_grammar_still_needed():
    gate = GrammarGate(Clock())
    gate.want(SCHEMA)
    gate.take_asks()
    gate.compiled([REGEX.key])
    gate.worker_lost([REGEX, None])
    assert sorted(g.kind for g in gate.take_asks()) == ["json", "regex"]
    assert gate.holds(SCHEMA) and gate.holds(REGEX)


def test_the_scheduler_holds_a_guided_request_until_its_result_reports_the_compile():
    scheduler, allocator, worker = make_stack()
    scheduler.add_request(make_request("g", guided=SCHEMA))
    scheduler.add_request(make_request("plain"))
    first = run_step(scheduler, allocator, worker)
    assert first.plan.compile_grammars == [SCHEMA]
    assert set(first.scheduled_tokens()) == {"plain"}  # the other runs meanwhile
    second = run_step(scheduler, allocator, worker)
    assert second.plan.compile_grammars == [] and "g" not in second.scheduled_tokens()
    third = scheduler.schedule()
    plan = scheduler.on_alloc(allocator.step(third))
    scheduler.on_result(StepResult(plan.step_id, compiled_grammars=[SCHEMA.key],
                                   sampled=worker.execute(plan).sampled))
    fourth = run_step(scheduler, allocator, worker)
    assert fourth.scheduled_tokens()["g"] == 8 and fourth.plan.compile_grammars == []
    allocator.check_integrity()


def test_a_request_with_a_compiled_grammar_is_not_held():
    scheduler, allocator, worker = make_stack()
    scheduler.grammars.compiled([SCHEMA.key])
    scheduler.add_request(make_request("g", guided=SCHEMA))
    record = run_step(scheduler, allocator, worker)
    assert record.plan.compile_grammars == [] and record.scheduled_tokens() == {"g": 8}
