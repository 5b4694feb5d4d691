"""A histogram observed without prometheus_client's lock (a bisect and two adds; the api observes once
per token of every stream), registered as one series api=<id>. Only the event loop's thread observes."""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class LatencyHistogram:
    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], api_id: str, registry) -> None:
        self.name, self.documentation, self.api_id = name, documentation, api_id
        self.bounds = tuple(float(b) for b in buckets)
        self._labels = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        self.counts = [0] * (len(self.bounds) + 1)  # counts[i]: bounds[i-1] < value <= bounds[i]
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self):
        counts, total, cumulative = list(self.counts), self.sum, 0  # a copy: buckets and count agree
        buckets = []
        for label, count in zip(self._labels, counts, strict=True):
            cumulative += count
            buckets.append((label, cumulative))
        family = HistogramMetricFamily(self.name, self.documentation, labels=["api"])
        family.add_metric([self.api_id], buckets, sum_value=total)
        yield family
