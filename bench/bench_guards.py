"""What guards (values the forward branched on, re-checked by replay) cost on c6 and c9.

usage: python bench/bench_guards.py [--quick]
Runs c6 (every-op ``tl.trace`` of GPT-2 small) and c9 (replaying an edit of h.8 at the last
position on an existing trace) with guards on, and with them off (the recorder told that no
function is a guard or a data read, as before guards existed), alternating the two in one
process. Prints one JSON line per (case, guards) with the ratio to a plain forward, and the
on/off quotient.
"""

from __future__ import annotations

import json
import statistics
import time

import torch  # noqa: E402
from common import gpt2_small, plain_forward, reps, setup

import torchlens as tl  # noqa: E402
from torchlens.capture import _classify  # noqa: E402 - the switch: the per-function guard flags


def set_guards(on: bool) -> None:
    """Guards on (the shipped behaviour) or off (no function classified as a guard or data read)."""
    _classify._CACHE.clear()
    if not on:
        original = _classify.FuncInfo.__init__

        def no_guards(self, func):
            original(self, func)
            self.guard = False
            self.data_read = False

        _classify.FuncInfo.__init__ = no_guards
        set_guards.restore = lambda: setattr(_classify.FuncInfo, "__init__", original)
    elif hasattr(set_guards, "restore"):
        set_guards.restore()
        del set_guards.restore
    _classify._CACHE.clear()


def ratio_pair(make_case, base, n: int) -> tuple[list[float], list[float]]:
    """Per-repetition ratios to ``base`` with guards on and off, interleaved."""
    on, off = [], []
    for _ in range(n):
        for flag, sink in ((True, on), (False, off)):
            set_guards(flag)
            case = make_case()
            case(), base()
            t0 = time.perf_counter()
            base()
            t1 = time.perf_counter()
            case()
            t2 = time.perf_counter()
            sink.append((t2 - t1) / (t1 - t0))
    set_guards(True)
    return on, off


def zero_last(out):
    out = out[0].clone() if isinstance(out, tuple) else out.clone()
    out[:, -1, :] = 0
    return out


def main() -> None:
    setup()
    model, ids = gpt2_small()
    base = plain_forward(model, ids)
    n = max(5, reps())

    def c6():
        return lambda: tl.trace(model, ids)

    def c9():
        trace = tl.trace(model, ids)
        return lambda: trace.fork().do("transformer.h.8", zero_last, replay="strict")

    for case, make in (("c6_gpt2_allops", c6), ("c9_gpt2_replay_h8", c9)):
        on, off = ratio_pair(make, base, n)
        a, b = statistics.median(on), statistics.median(off)
        print(json.dumps({"case": case, "guards_on": round(a, 3), "guards_off": round(b, 3),
                          "on_over_off": round(a / b, 3), "reps": n}), flush=True)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
