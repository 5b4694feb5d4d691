"""lifo: the latest arrival first (a test plugin for pagedserve's policy entry points)."""

from pagedserve.services.scheduler.policy import SchedulingPolicy, arrival_key


class LIFOPolicy(SchedulingPolicy):
    name = "lifo"

    def order_waiting(self, waiting, running):
        return sorted(waiting, key=arrival_key, reverse=True)

    def order_running(self, running):
        return sorted(running, key=arrival_key, reverse=True)
