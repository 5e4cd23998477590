"""``tracer.barrier(n)``: a point ``n`` blocks of one trace all pass together.

Blocks run in the order the model reaches what each asked for, so a block that
hands a value to another needs a meeting point: each caller parks until the
``n``-th arrives, which releases the rest before carrying on itself.
"""

from __future__ import annotations

from . import _worker

__all__ = ["Barrier"]


class Barrier:
    """Park callers until ``n`` of them have arrived; reusable round after round."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._waiting: list[_worker.Worker] = []

    def __call__(self) -> None:
        self._waiting.append(_worker.current("tracer.barrier()"))
        if len(self._waiting) < self.n:
            _worker.wait_at_barrier()
            return
        waiting, self._waiting = self._waiting[:-1], []
        for other in waiting:
            try:
                other.pending = other.resume()
            except BaseException:
                other.pending = None
                raise
