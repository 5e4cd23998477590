"""How far TorchLens sits above what a case cannot go below, measured in one process.

usage: python bench/bench_floors.py [fixed] [replay] [--quick]

fixed   c1 (a module read on the tiny GPT-2) as a long alternating loop (2,000 pairs: bench_torchlens.py
        times 15, too few to tell 1.10 from 1.15), beside a plain forward hook read and the least an
        exact read must do (a hook that copies the output, a compare after the forward: what
        ``tl.extract`` promises, a value equal to what the hook saw). Then the cost of each part of
        the capture's fixed work right after a forward, as the capture meets it (the forward leaves
        caches cold: the same code costs several times what it costs in a warm loop).
replay  c9 (one replay, an edit of transformer.h.8 on GPT-2 small) and c8 via ``trace.forks``: each
        replay's torch calls are recorded (a TorchFunctionMode) and re-issued alone in a loop; the
        replay minus that floor is TorchLens's Python.

Prints one JSON line per figure (ratios to a plain forward timed back to back in the same process).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from common import gpt2_small, gpt2_tiny, hook_read, plain_forward, setup
from torch.overrides import TorchFunctionMode

import torchlens as tl


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def ratio_loop(base: Callable[[], Any], fns: dict[str, Callable[[], Any]], n: int, blocks: int = 4) -> dict[str, float]:
    """Median over ``n`` pairs of each ``fn``'s time over the plain forward timed just before it.

    Each ``fn`` alternates with the forward alone (what one runs after shapes its time: a
    round-robin of several ``fn`` moved c1 by up to 0.05 with its place in the round), in
    ``blocks`` runs taken in turn so that a drift of the machine meets every ``fn``.
    """
    for f in (base, *fns.values()):
        f(), f()
    got: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(blocks):
        for k, f in fns.items():
            ratios = got[k]
            for _ in range(max(1, n // blocks)):
                t0 = time.perf_counter()
                base()
                t1 = time.perf_counter()
                f()
                t2 = time.perf_counter()
                ratios.append((t2 - t1) / (t1 - t0))
    return {k: round(statistics.median(v), 4) for k, v in got.items()}


def cold_us(base: Callable[[], Any], pieces: dict[str, Callable[[], Any]], n: int) -> dict[str, float]:
    """Median µs of each piece run right after a plain forward."""
    got: dict[str, list[int]] = {k: [] for k in pieces}
    for f in pieces.values():
        f()
    for _ in range(n):
        for k, f in pieces.items():
            base()
            t0 = time.perf_counter_ns()
            f()
            got[k].append(time.perf_counter_ns() - t0)
    return {k: round(statistics.median(v) / 1000, 1) for k, v in got.items()}


def fixed(quick: bool) -> None:
    from torchlens._interrupts import HoldInterrupts
    from torchlens.arch.resolve import bind
    from torchlens.capture.hooks import ModuleHooks
    from torchlens.core.builder import TraceBuilder
    from torchlens.core.selectors import as_selector

    model, ids = gpt2_tiny()
    base = plain_forward(model, ids)
    block = model.get_submodule("transformer.h.0")

    def exact_read() -> Any:
        seen = {}

        def hook(module, args, kwargs, out):
            seen["o"] = (out, out.clone(), out._version)

        handle = block.register_forward_hook(hook, with_kwargs=True)
        try:
            with torch.no_grad():
                model(ids)
        finally:
            handle.remove()
        out, copy, version = seen["o"]
        return out if out._version == version and torch.equal(out, copy) else copy

    n = 300 if quick else 2000
    ratios = ratio_loop(base, {"plain_hooks": lambda: hook_read(model, "transformer.h.0", ids),
                               "exact_read": exact_read,
                               "tl.extract": lambda: tl.extract(model, ids, ["transformer.h.0"])}, n)
    emit(case="c1_tiny_read_long", pairs=n, **ratios,
         note="median of per-pair ratios; exact_read: a hook that copies, a compare after (the floor of the promise)")

    out = torch.randn(1, 16, 32)
    copy = out.clone()

    def hold() -> None:
        with HoldInterrupts():
            pass

    def hooks_cycle() -> None:
        hooks = ModuleHooks(model)
        hooks.on_output("transformer.h.0", lambda *a: None)
        with hooks:
            pass

    def builder() -> None:
        TraceBuilder(model, (ids,), {}, engine="hooks", op_graph=False).finish(None, steps=[])

    pieces = {"nothing": lambda: None, "ctrl_c_hold": hold, "clone": out.clone, "equal": lambda: torch.equal(out, copy),
              "hooks_on_and_off": hooks_cycle, "trace_builder": builder,
              "bind_site": lambda: bind(model, as_selector("transformer.h.0"))}
    emit(case="c1_parts_after_a_forward_us", **cold_us(base, pieces, 200 if quick else 1000),
         note="each part alone, right after a plain forward; 'nothing' is the timer's own cost")


class _Calls(TorchFunctionMode):
    """Records every torch call made inside it (shape and dtype reads left out)."""

    SKIP = {torch.Tensor.shape.__get__, torch.Tensor.dim, torch.Tensor.size, torch.Tensor.dtype.__get__,
            torch.Tensor.device.__get__, torch.Tensor.is_meta.__get__, torch.Tensor.layout.__get__,
            torch.Tensor.numel, torch.Tensor.requires_grad.__get__, torch.Tensor._version.__get__}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in self.SKIP:
            self.calls.append((func, args, kwargs))
        return out


def replay(quick: bool) -> None:
    model, ids = gpt2_small()
    base = plain_forward(model, ids)
    trace = tl.trace(model, ids)
    blocks = [f"transformer.h.{i}" for i in range(12)]

    def double_last(o):
        o = o.clone()
        o[:, -1] *= 2
        return o

    def zero_last(o):
        o = o.clone()
        o[:, -1] = 0
        return o

    cases = {"c9_one_replay": lambda: trace.fork().do(tl.module("transformer.h.8"), double_last).output.logits,
             "c8_forks_replay": lambda: [f.output.logits[0, -1, 0]
                                         for f in trace.forks([(tl.module(b), zero_last) for b in blocks])]}
    for name, fn in cases.items():
        fn()
        with _Calls() as mode:
            fn()
        calls = mode.calls

        def torch_only(calls=calls) -> None:
            for func, args, kwargs in calls:
                func(*args, **kwargs)

        n = 5 if quick else (30 if name.startswith("c9") else 10)
        ratios = ratio_loop(base, {"replay": fn, "its_torch_calls_alone": torch_only}, n)
        emit(case=name, torch_calls=len(calls), **ratios,
             python=round(ratios["replay"] - ratios["its_torch_calls_alone"], 4),
             note="ratios to a plain forward; python = replay - its torch calls alone")


def main() -> None:
    setup()
    quick = "--quick" in sys.argv
    parts = [a for a in sys.argv[1:] if not a.startswith("--")] or ["fixed", "replay"]
    if "fixed" in parts:
        fixed(quick)
    if "replay" in parts:
        replay(quick)


if __name__ == "__main__":
    main()
