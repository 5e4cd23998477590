"""``nnsight.intervention.interleaver``: the run's control-flow names.

`EarlyStopException` and `OutOfOrderError` are what user code catches; `Event` and `Pending`
describe a parked block's request. `Interleaver` and `Mediator` are nnsight's machinery: importable,
refused with `InternalsUnsupportedError` when built.
"""

from __future__ import annotations

from ..interleaver import EarlyStopException, Event, Interleaver, Mediator, OutOfOrderError, Pending

__all__ = [
    "EarlyStopException",
    "Event",
    "Interleaver",
    "Mediator",
    "OutOfOrderError",
    "Pending",
]
