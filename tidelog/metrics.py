"""Client metrics under Kafka's names: ``Producer.metrics()`` and ``Consumer.metrics()``.

A client records a value once per batch, request or fetch answer, never per record, so
measuring costs nothing next to the work measured. ``ClientMetrics.snapshot()`` gives
a plain ``{name: float}`` dict, as Kafka's ``metrics()`` maps a MetricName to a value:

* counters (``*-total``) are cumulative since the client started;
* a sensor is one observed quantity (bytes per batch, records per request) reported
  as ``<name>-avg`` and ``<name>-max`` over the client's life, 0.0 before any
  observation. Kafka keeps these over a sliding window (``metrics.sample.window.ms``);
  a benchmark or a caller that wants a window takes two snapshots and compares.

Thread-safe: producers and consumers record from their I/O threads while callers read.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class ClientMetrics:
    """Named counters and sensors, fixed when the client starts (a name not declared
    there is a bug, so ``add`` and ``record`` raise KeyError for it)."""

    def __init__(self, counters: Iterable[str], sensors: Iterable[str]) -> None:
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(counters, 0)
        # name -> [observations, sum, max]
        self._sensors = {name: [0, 0.0, 0.0] for name in sensors}

    def add(self, counter: str, amount: int = 1) -> None:
        with self._lock:
            self._counters[counter] += amount

    def record(self, sensor: str, value: float) -> None:
        with self._lock:
            stats = self._sensors[sensor]
            stats[0] += 1
            stats[1] += value
            stats[2] = max(stats[2], value)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out = {name: float(value) for name, value in self._counters.items()}
            for name, (count, total, high) in self._sensors.items():
                out[f"{name}-avg"] = total / count if count else 0.0
                out[f"{name}-max"] = float(high)
        return out
