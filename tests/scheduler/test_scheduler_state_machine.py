"""Random interleavings of add, step and abort against the counting kvstore double."""

from hypothesis import HealthCheck, settings

from tests.scheduler.scheduler_machine import AsyncSchedulerMachine, SchedulerMachine

TestSchedulerWithCountingAllocator = SchedulerMachine.TestCase
TestSchedulerWithCountingAllocator.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    report_multiple_bugs=False,
)

TestAsyncSchedulerWithCountingAllocator = AsyncSchedulerMachine.TestCase
TestAsyncSchedulerWithCountingAllocator.settings = TestSchedulerWithCountingAllocator.settings
