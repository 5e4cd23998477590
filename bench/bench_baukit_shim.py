"""What the baukit shim costs on top of a plain forward of GPT-2 small (random weights).

Cases of ../shared/bench-spec.md that baukit code can express: GPT2Config() defaults,
eval, one thread, seed 0, ids = arange(64) % 50257, everything under torch.no_grad().
Each case is timed alternately with the plain forward (bench/common.py ``measure``), and
the Trace/TraceDict is built inside the timed region, as baukit code builds one per
forward. ``ok`` compares the case's values with the same read or edit done with a plain
``register_forward_hook`` (allclose, atol 1e-5).

    python bench/bench_baukit_shim.py [--quick]

prints one JSON line per case, then the process's peak RSS.
"""

from __future__ import annotations

import torch
from common import close, emit, emit_rss, gpt2_small, measure, setup
from torchlens_shims.baukit import Trace, TraceDict

TOOL = "torchlens_shims.baukit"


def _plain(model, hooks: dict, ids):
    """Logits of a forward with plain ``{name: hook}`` forward hooks attached."""
    handles = [model.get_submodule(n).register_forward_hook(fn) for n, fn in hooks.items()]
    try:
        return model(ids).logits
    finally:
        for handle in handles:
            handle.remove()


def double_last(output):
    """The c5 edit: last position of the block's output times two, in place."""
    output[:, -1, :] *= 2
    return output


def main() -> None:
    setup()
    model, ids = gpt2_small()
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

    def trace_edit():
        with Trace(model, "transformer.h.8", edit_output=double_last):
            return model(ids).logits

    with torch.no_grad():
        seen: dict = {}

        def keep(name):
            def hook(module, args, output):
                seen[name] = output

            return hook

        clean = _plain(model, {b: keep(b) for b in blocks}, ids)
        edited = _plain(model, {"transformer.h.8": lambda m, a, o: double_last(o)}, ids)
        cases = {
            "forward": (forward, lambda: close(forward(), clean)),
            "c3_gpt2_read1": (trace_read, lambda: close(trace_read(), seen["transformer.h.5"])),
            "c4_gpt2_readall": (
                tracedict_read,
                lambda: all(close(got, seen[b]) for got, b in zip(tracedict_read(), blocks)),
            ),
            "c5_gpt2_edit": (trace_edit, lambda: close(trace_edit(), edited) and not close(edited, clean)),
        }
        for name, (case, check) in cases.items():
            ok = check()
            ms, base_ms, ratio = measure(case, forward)
            emit(TOOL, name, ms, base_ms, ok, ratio=ratio)
    emit_rss(TOOL)


if __name__ == "__main__":
    main()
