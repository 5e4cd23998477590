"""TorchLens and plain forward hooks on the cases of ../shared/bench-spec.md.

usage: python bench/bench_torchlens.py [--quick] [--tool torchlens|plain_hooks]
Prints one JSON line per (tool, case) and a final peak-RSS line per tool.
"""

from __future__ import annotations

import sys

import torch  # noqa: E402
from common import (
    close,
    emit_rss,
    gpt2_small,
    gpt2_tiny,
    hook_edit,
    hook_read,
    minilm,
    plain_forward,
    run_case,
    setup,
)

import torchlens as tl  # noqa: E402


def set_first_two(out):
    out = out.clone()
    out[:, :, :2] = 2.5
    return out


def double_last(out):
    out = out.clone()
    out[:, -1, :] *= 2
    return out


def zero_last(out):
    out = out.clone()
    out[:, -1, :] = 0
    return out


def torchlens_cases() -> None:
    tool = "torchlens"
    model, ids = gpt2_tiny()
    base = plain_forward(model, ids)
    ref, _ = hook_read(model, "transformer.h.0", ids)
    got = tl.extract(model, ids, ["transformer.h.0"])["transformer.h.0"]
    run_case(tool, "c1_tiny_read", lambda: tl.extract(model, ids, ["transformer.h.0"]), base, close(got, ref))

    def c2():
        t = tl.trace(model, ids, intervene=tl.when(tl.module("transformer.h.0"), set_first_two),
                     save=tl.module("transformer.h.0"))
        return t["transformer.h.0"].out, t.output.logits

    h0, logits = c2()
    want = hook_edit(model, "transformer.h.0", set_first_two, ids).logits
    run_case(tool, "c2_tiny_edit", c2, base, close(logits, want) and bool((h0[:, :, :2] == 2.5).all()))
    run_case(tool, "c2b_tiny_trace_allops", lambda: tl.trace(model, ids), base, True,
         "tl.trace recording every op on the tiny model")

    model, ids = gpt2_small()
    base = plain_forward(model, ids)
    ref, _ = hook_read(model, "transformer.h.5", ids)
    got = tl.extract(model, ids, ["transformer.h.5"])["transformer.h.5"]
    run_case(tool, "c3_gpt2_read1", lambda: tl.extract(model, ids, ["transformer.h.5"]), base,
         close(got, ref))
    blocks = [f"transformer.h.{i}" for i in range(12)]
    got = tl.extract(model, ids, blocks)
    ok = all(close(got[b], hook_read(model, b, ids)[0]) for b in (blocks[0], blocks[11]))
    run_case(tool, "c4_gpt2_readall", lambda: tl.extract(model, ids, blocks), base, ok)

    def c5():
        t = tl.trace(model, ids, intervene=tl.when(tl.module("transformer.h.8"), double_last),
                     save=tl.module("transformer.h.8"))
        return t.output.logits

    want = hook_edit(model, "transformer.h.8", double_last, ids).logits
    run_case(tool, "c5_gpt2_edit", c5, base, close(c5(), want))

    full = tl.trace(model, ids)
    ok = close(full["transformer.h.5"].out, ref) and close(full.output.logits, hook_read(model, "lm_head", ids)[0])
    run_case(tool, "c6_gpt2_allops", lambda: tl.trace(model, ids), base, ok,
         f"{len(full.ops)} ops recorded")

    def c8():
        t = tl.trace(model, ids)
        return [t.fork().do(tl.module(b), zero_last).output.logits[0, -1, 0] for b in blocks]

    got = c8()
    want = [hook_edit(model, b, zero_last, ids).logits[0, -1, 0] for b in blocks]
    ok = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))
    run_case(tool, "c8_gpt2_ablate_sweep", c8, base, ok,
             "one tl.trace + 12 forks replayed; 12 plain forwards would be 12.0",
             n=3 if "--quick" in sys.argv else 5)

    def c8_forks():
        t = tl.trace(model, ids)
        return [f.output.logits[0, -1, 0] for f in t.forks([(tl.module(b), zero_last) for b in blocks])]

    ok = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(c8_forks(), want))
    run_case(tool, "c8_gpt2_ablate_sweep_forks", c8_forks, base, ok,
             "c8 with trace.forks: the 12 forks swept through the graph in one pass, their rows stacked per op",
             n=3 if "--quick" in sys.argv else 5)

    def c8_sweep():
        t = tl.trace(model, ids)
        with t.sweep():  # c8's loop unchanged, its forks queued and replayed together at the block's end
            made = [t.fork().do(tl.module(b), zero_last) for b in blocks]
        return [f.output.logits[0, -1, 0] for f in made]

    ok = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(c8_sweep(), want))
    run_case(tool, "c8_gpt2_ablate_sweep_context", c8_sweep, base, ok,
             "c8's loop inside `with trace.sweep():` (c8_gpt2_ablate_sweep is the loop alone), outputs read after it",
             n=3 if "--quick" in sys.argv else 5)

    def c9():
        return full.fork().do(tl.module("transformer.h.8"), double_last).output.logits

    run_case(tool, "c9_gpt2_replay_h8", c9, base, close(c9(), hook_edit(model, "transformer.h.8",
                                                                              double_last, ids).logits))

    model, ids = gpt2_small(attn="eager")  # what reading attention patterns needs
    base = plain_forward(model, ids)
    want = [hook_edit(model, b, zero_last, ids).logits[0, -1, 0] for b in blocks]
    ok = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(c8_forks(), want))
    run_case(tool, "c8_gpt2_ablate_sweep_forks_eager", c8_forks, base, ok,
             "c8 with trace.forks on GPT-2 small with eager attention: the scores per fork until the causal mask",
             n=3 if "--quick" in sys.argv else 5)

    model, ids = minilm()
    base = plain_forward(model, input_ids=ids)
    layers = [f"encoder.layer.{i}" for i in range(6)]
    got = tl.extract(model, {"input_ids": ids}, layers)
    ok = close(got[layers[3]], hook_read(model, layers[3], input_ids=ids)[0])
    run_case(tool, "c7_minilm_readall", lambda: tl.extract(model, {"input_ids": ids}, layers), base, ok)
    emit_rss(tool)


def plain_hook_cases() -> None:
    tool = "plain_hooks"
    model, ids = gpt2_small()
    base = plain_forward(model, ids)
    run_case(tool, "c3_gpt2_read1", lambda: hook_read(model, "transformer.h.5", ids), base, True)

    def read_all():
        seen = []
        handles = [model.transformer.h[i].register_forward_hook(lambda m, i, o: seen.append(o)) for i in range(12)]
        try:
            with torch.no_grad():
                model(ids)
        finally:
            for h in handles:
                h.remove()
        return seen

    run_case(tool, "c4_gpt2_readall", read_all, base, len(read_all()) == 12)
    run_case(tool, "c5_gpt2_edit", lambda: hook_edit(model, "transformer.h.8", double_last, ids), base, True)
    emit_rss(tool)


if __name__ == "__main__":
    setup()
    which = sys.argv[sys.argv.index("--tool") + 1] if "--tool" in sys.argv else "all"
    if which in ("all", "torchlens"):
        torchlens_cases()
    if which in ("all", "plain_hooks"):
        plain_hook_cases()
