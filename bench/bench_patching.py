"""Patching workflows on GPT-2 small (random weights, 1×64, CPU, one thread): issue 17's grid case.

usage: python bench/bench_patching.py [--quick]

- ``grid_resid_pre``: activation patching of ``resid_pre``, 12 layers × 64 positions (``--quick``:
  12 × 8, positions 0, 8, ..., 56), logit-difference metric, through ``tl.patching``; the
  figure is the cost per cell (two traces included) over one plain forward.
- ``grid_resid_pre`` for ``plain_hooks``: the same cells, each one plain forward with a
  pre-hook writing the clean row (what TransformerLens / nnsight / baukit loops do), timed
  on a sample of cells (every cell costs one forward).
- ``attribution_vs_exact``: attribution patching of the same grid; ``note`` gives its Pearson
  correlation with the exact grid (the issue asks for the figure, not a target).
Prints one JSON line per case (see ../shared/bench-spec.md).
"""

from __future__ import annotations

import sys
import time

import torch
from common import emit, emit_rss, gpt2_small, median_ms, plain_forward, setup

import torchlens as tl


def _pre_hook_cell(model, ids, layer: int, p: int, donor: torch.Tensor):
    def pre(m, args, kwargs):
        x = (args[0] if args else kwargs["hidden_states"]).clone()
        x[:, p] = donor[:, p]
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    handle = model.transformer.h[layer].register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            return model(ids)
    finally:
        handle.remove()


def main() -> None:
    setup()
    quick = "--quick" in sys.argv
    model, clean_ids = gpt2_small()
    corrupt_ids = clean_ids.clone()
    corrupt_ids[0, 20], corrupt_ids[0, 40] = 777, 4242
    base = plain_forward(model, clean_ids)
    base_ms = median_ms(base, 5)
    with torch.no_grad():
        correct = int(model(clean_ids).logits[0, -1].argmax())
        wrong = int(model(corrupt_ids).logits[0, -1].argmax())
    if wrong == correct:
        wrong = (correct + 1) % 50257
    metric = tl.patching.logit_diff(correct, wrong)
    positions = list(range(0, 64, 8)) if quick else list(range(64))
    cells = 12 * len(positions)

    t0 = time.perf_counter()
    clean, corrupted = tl.trace(model, clean_ids), tl.trace(model, corrupt_ids)
    grid = tl.patching.activation_patching(clean, corrupted, metric, site="resid_pre", positions=positions,
                                           progress=False)
    grid_ms = (time.perf_counter() - t0) * 1000

    donors = {}
    for layer in range(12):
        seen = {}
        h = model.transformer.h[layer].register_forward_pre_hook(
            lambda m, a, k, seen=seen: seen.update(v=(a[0] if a else k["hidden_states"]).clone()), with_kwargs=True)
        with torch.no_grad():
            model(clean_ids)
        h.remove()
        donors[layer] = seen["v"]
    sample = [(layer, positions[(3 * layer) % len(positions)]) for layer in range(12)]
    ok = all(abs(float(metric(_pre_hook_cell(model, corrupt_ids, layer, p, donors[layer])))
                 - float(grid.values[layer, positions.index(p)])) < 1e-4 for layer, p in sample)
    emit("torchlens", "grid_resid_pre", grid_ms / cells, base_ms, ok,
         f"{12}x{len(positions)} cells, per-cell cost incl. 2 traces; total {grid_ms / 1000:.1f}s; "
         "target <= 0.35, floor ~0.27")

    t0 = time.perf_counter()
    for layer, p in sample:
        _pre_hook_cell(model, corrupt_ids, layer, p, donors[layer])
    plain_cell = (time.perf_counter() - t0) * 1000 / len(sample)
    emit("plain_hooks", "grid_resid_pre", plain_cell, base_ms, True,
         f"one forward per cell (timed on {len(sample)} cells; every peer re-runs each cell)")

    t0 = time.perf_counter()
    estimate = tl.patching.attribution_patching(clean, corrupted, metric, site="resid_pre")
    attr_ms = (time.perf_counter() - t0) * 1000
    a = estimate.values[:, positions].flatten() - estimate.corrupted
    b = grid.values.flatten() - grid.corrupted
    corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    emit("torchlens", "attribution_vs_exact", attr_ms, base_ms, corr == corr,
         f"Pearson r with exact patching = {corr:.3f} over {cells} cells (one forward + one backward)")
    emit_rss("torchlens")


if __name__ == "__main__":
    main()
