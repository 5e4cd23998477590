"""Ctrl-C held off while a few statements that must run whole do: putting a capture on a model,
taking it off, moving a save into place.

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread, so a Ctrl-C
pressed while a capture takes its hooks off could leave half of them on the model, and one
pressed between the two renames of an overwriting save could leave neither save in place.
Inside ``with HoldInterrupts():`` a SIGINT is noted instead, and handed to the handler that
was there before (``KeyboardInterrupt`` by default) as the block ends, where the state is whole
again. Only the main thread receives SIGINT in Python, so elsewhere this does nothing; nested
holds install the handler once.
"""

from __future__ import annotations

import _signal  # the C module: signal.signal wraps it with enum conversions, ~10x slower per call
import signal
import sys
import threading
from typing import Any

__all__ = ["Attached", "HoldInterrupts", "interrupts_held"]

_MAIN = threading.main_thread().ident
_get_ident = threading.get_ident
_SIGINT = int(signal.SIGINT)
_STATE: list[Any] = [0, None, None]  # (holds open in the main thread, the handler before, a SIGINT noted meanwhile)


def interrupts_held() -> bool:
    """Whether a ``HoldInterrupts`` block is open already where it would act (a nested one adds
    nothing then; outside the main thread one does nothing at all)."""
    return _STATE[0] > 0 or _get_ident() != _MAIN


def _note(signum: int, frame: Any) -> None:
    _STATE[2] = (signum, frame)


class HoldInterrupts:
    """``with HoldInterrupts():`` a SIGINT arriving in the block is raised (by the earlier handler)
    as the block ends, not in the middle of it."""

    __slots__ = ("held",)

    def __enter__(self) -> HoldInterrupts:
        self.held = False
        if _get_ident() != _MAIN:
            return self
        if _STATE[0] == 0:
            try:
                _STATE[1] = _signal.signal(_SIGINT, _note)
            except (ValueError, OSError):  # not the main interpreter: nothing to hold
                return self
            _STATE[2] = None
        _STATE[0] += 1
        self.held = True
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.held:
            return
        self.held = False
        _STATE[0] -= 1
        if _STATE[0]:
            return
        previous, pending = _STATE[1], _STATE[2]
        _STATE[1] = _STATE[2] = None
        _signal.signal(_SIGINT, previous if previous is not None else signal.default_int_handler)
        if pending is None:
            return
        if callable(previous):
            previous(*pending)  # signal.default_int_handler raises KeyboardInterrupt here
        elif previous == signal.SIG_DFL:
            signal.raise_signal(_SIGINT)  # what the signal would have done: end the process


class Attached:
    """``with Attached(a, b):`` is ``with a, b:`` for what a capture puts on a model and takes off
    again (module hooks, a function mode, grad mode): each is entered and exited with Ctrl-C held
    off, and whatever was entered is always exited, also when a Ctrl-C held during the entries is
    raised as they end."""

    __slots__ = ("managers", "entered")

    def __init__(self, *managers: Any) -> None:
        self.managers = managers
        self.entered: list[Any] = []

    def __enter__(self) -> Attached:
        try:
            with HoldInterrupts():
                for manager in self.managers:
                    manager.__enter__()
                    self.entered.append(manager)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        failed: BaseException | None = None
        with HoldInterrupts():
            entered = self.entered
            while entered:
                manager = entered.pop()
                try:
                    manager.__exit__(*exc)
                except BaseException as error:  # noqa: BLE001 - the others are exited first, then it is raised
                    failed = failed or error
        if failed is not None:
            raise failed
