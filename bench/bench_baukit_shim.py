"""What the baukit shim costs on top of a plain forward of GPT-2 small (random weights).

Each case is timed interleaved with a plain forward (base, case, base, case ...) so both
medians see the same machine state; the Trace/TraceDict is built inside the timed
region, as baukit code builds one per forward. Every case's value is checked against
the same read or edit done with a plain ``register_forward_hook``.

    python bench/bench_baukit_shim.py [--quick]

prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import transformers
from torchlens_shims.baukit import Trace, TraceDict

TOOL = "torchlens_shims.baukit"


def _ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000.0


Thunk = Callable[[], object]


def _timed(base: Thunk, case: Thunk, warmup: int, reps: int) -> tuple[float, float]:
    for _ in range(warmup):
        base()
        case()
    base_ms, case_ms = [], []
    for rep in range(reps):
        # Alternate which goes first so a drifting machine load biases neither.
        if rep % 2:
            case_ms.append(_ms(case))
            base_ms.append(_ms(base))
        else:
            base_ms.append(_ms(base))
            case_ms.append(_ms(case))
    return statistics.median(case_ms), statistics.median(base_ms)


def _plain(model, hooks: dict, ids):
    handles = [model.get_submodule(n).register_forward_hook(fn) for n, fn in hooks.items()]
    try:
        return model(ids).logits
    finally:
        for h in handles:
            h.remove()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions instead of 15")
    args = parser.parse_args(argv)
    reps, warmup = (3, 2) if args.quick else (15, 2)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    ids = torch.arange(64)[None] % 50257
    blocks = [f"transformer.h.{i}" for i in range(model.config.n_layer)]

    def forward():
        return model(ids).logits

    def trace_read():
        with Trace(model, "transformer.h.5") as tr:
            model(ids)
        return tr.output

    def tracedict_read():
        with TraceDict(model, blocks) as td:
            model(ids)
        return [td[b].output for b in blocks]

    def double_last(output):
        output[:, -1, :] *= 2
        return output

    def trace_edit():
        with Trace(model, "transformer.h.8", edit_output=double_last):
            return model(ids).logits

    with torch.no_grad():
        seen: dict = {}

        def keep(name):
            def hook(module, hook_args, output):
                seen[name] = output

            return hook

        clean = _plain(model, {b: keep(b) for b in blocks}, ids)
        edited = _plain(model, {"transformer.h.8": lambda m, a, o: double_last(o)}, ids)
        checks = {
            "forward": lambda: torch.equal(forward(), clean),
            "trace_read_h5": lambda: torch.equal(trace_read(), seen["transformer.h.5"]),
            "tracedict_read_12_blocks": lambda: all(
                torch.equal(got, seen[b]) for got, b in zip(tracedict_read(), blocks)
            ),
            "trace_edit_h8_last_token_x2": lambda: (
                torch.equal(trace_edit(), edited) and not torch.equal(edited, clean)
            ),
        }
        cases = {
            "forward": forward,
            "trace_read_h5": trace_read,
            "tracedict_read_12_blocks": tracedict_read,
            "trace_edit_h8_last_token_x2": trace_edit,
        }
        for name, case in cases.items():
            ok = bool(checks[name]())
            ms, base_ms = _timed(forward, case, warmup, reps)
            row = {
                "tool": TOOL,
                "case": name,
                "ms": round(ms, 3),
                "base_ms": round(base_ms, 3),
                "ratio": round(ms / base_ms, 4),
                "ok": ok,
                "note": "",
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
