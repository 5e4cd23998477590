"""What reading attention facets costs, next to one eager-attention forward (GPT-2 small).

Facets are computed lazily from the fused ``scaled_dot_product_attention`` ops of a trace,
so capture pays nothing for them; this measures the read. The base of every ratio is one
forward of the same model (same weights) loaded with ``attn_implementation="eager"`` on the
same 1x64 input, timed alternately in this process on one CPU thread. Values are checked
against that eager model's ``output_attentions`` (and, for the patch, a plain pre-hook on
``c_proj``).

    python bench/bench_facets.py [--quick]

prints one JSON line per case.
"""

from __future__ import annotations

import copy

import torch
from common import emit, gpt2_small, measure, setup

import torchlens as tl
from torchlens.mechinterp import patch_head

TOOL = "torchlens.facets"
SDPA = "scaled_dot_product_attention"


def main() -> None:
    setup()
    model, ids = gpt2_small()
    model.set_attn_implementation("sdpa")
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        want = eager(ids, output_attentions=True).attentions

    def eager_forward():
        with torch.no_grad():
            return eager(ids)

    trace = tl.trace(model, ids)
    sites = list(trace.find_sites(tl.func(SDPA)))
    assert len(sites) == 12

    def read_all():
        out = []
        for site in sites:
            f = site.facets  # a fresh facet object: nothing cached from the previous repetition
            out.append((f.scores, f.pattern, f.head_out))
        return out

    def read_patterns():
        return [site.facets.pattern for site in sites]

    got = read_all()
    ok = all(torch.allclose(p, w, atol=1e-5) for (_, p, _), w in zip(got, want))
    ms, base, ratio = measure(read_all, eager_forward)
    emit(TOOL, "read_all_facets_12_layers_1x64", ms, base, ok, "scores+pattern+head_out of every layer "
         "vs one eager-attention forward", ratio)
    ms, base, ratio = measure(read_patterns, eager_forward)
    emit(TOOL, "read_all_patterns_12_layers_1x64", ms, base, ok, "pattern of every layer", ratio)

    # head-level patching by replay on a fork, vs the eager forward with a plain hook edit
    def hooked():
        def pre(module, args):
            x = args[0].clone()
            x[..., 3 * 64:4 * 64] = 0.0
            return (x,)

        handle = eager.transformer.h[5].attn.c_proj.register_forward_pre_hook(pre)
        try:
            with torch.no_grad():
                return eager(ids).logits
        finally:
            handle.remove()

    fork = patch_head(trace, 5, 3)
    ok = torch.allclose(fork.output.logits, hooked(), atol=1e-4)
    ms, base, ratio = measure(lambda: patch_head(trace, 5, 3).output, hooked)
    emit(TOOL, "patch_head_output_replay_1x64", ms, base, ok, "zero-ablate L5H3 on a fork vs eager forward "
         "with a c_proj pre-hook", ratio)
    pattern = torch.tril(torch.ones(64, 64)) / torch.arange(1, 65)[:, None]
    fork = patch_head(trace, 5, 3, source=pattern, what="pattern")
    ms, base, ratio = measure(lambda: patch_head(trace, 5, 3, source=pattern, what="pattern").output,
                              eager_forward)
    emit(TOOL, "patch_head_pattern_replay_1x64", ms, base, bool(torch.isfinite(fork.output.logits).all()),
         "set L5H3's pattern on a fused model (recomputed from facets) vs one eager forward", ratio)


if __name__ == "__main__":
    main()
