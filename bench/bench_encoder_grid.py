"""The encoder grid: activation patching on BERT-base (random weights, 1×8 tokens, CPU, one thread).

usage: python bench/bench_encoder_grid.py [--quick] [--sweep] [--encoder-only] [--heads] [--causal-trace]

- ``encoder_grid``: ``tl.patching.activation_patching(clean, corrupted, metric, site="resid_pre")``
  over 12 layers × 8 positions of ``transformers.BertModel(BertConfig())`` (seed 0); the
  metric reads two features of the last position's final hidden state. The figure is the cost
  per cell (the two traces included) in plain forwards timed back to back with it.
- ``encoder_grid`` for ``plain_hooks``: every cell one plain forward with a pre-hook writing
  the clean row into the block's input (what TransformerLens / nnsight / baukit loops do).
- ``encoder_grid_sliced``: the same grid with ``batched_cells=False`` (every cell a sliced fork,
  as before batched cells existed).
- ``gpt2_grid_quick``: GPT-2 small 1×64, 12 layers × 8 positions (0, 8, ..., 56) as
  ``bench_patching.py --quick`` runs it: the long-sequence reference that must not regress.
- ``--sweep`` adds what the rule of ``activation_patching(batched_cells=None)`` was picked by:
  ``encoder_grid_k{2,4}`` (``batch_size`` 2 or 4 positions of every layer per batch),
  ``encoder_grid_seq{32,64}_{batched,sliced}`` (longer prompts, 8 positions each), and GPT-2
  small batched on 64 tokens and both ways on 8 tokens (causal attention).
- ``--heads`` runs only the head grids (``site="heads"``), batched and as sliced forks alternately
  in one process, each round against plain forwards timed around it: ``encoder_heads`` (BERT-base
  1x8, 12 layers x 12 heads, each head at every position), ``encoder_heads_pos3`` (the same heads
  at positions 0, 3, 7), ``gpt2_heads_seq8`` (GPT-2 small 1x8, causal attention) and
  ``gpt2_heads_seq8_pos3``; ``ok``: sampled cells equal a plain pre-hook writing the clean
  head's slice into the output projection's input (TransformerLens' ``hook_z`` patching).
- ``--causal-trace`` runs only ``tl.patching.causal_trace`` (``kinds=("resid_post",)``, 3 noised
  runs, subject positions 1-2), batched and as sliced forks alternately: ``encoder_causal_trace``
  on ``BertForMaskedLM(BertConfig())`` 1x8 and ``gpt2_causal_trace_seq8`` on GPT-2 small 1x8; the
  figure is per cell and noised run (12 x 8 x 3 restorations); ``ok``: sampled cells equal ROME's
  ``trace_with_patch`` written with plain hooks.
- ``--whole-row`` runs only GPT-2 small grids whose metric reads the whole output row (the correct
  token's probability), 8, 16 and 32 tokens, batched cells and sliced forks:
  ``gpt2_grid_prob_seq{n}_{batched,sliced}`` (the rule ``tl.patching.CAUSAL_BATCHED_TOKENS``).
Prints one JSON line per case (see ../shared/bench-spec.md).
"""

from __future__ import annotations

import sys
import time

import torch
from common import emit, gpt2_small, median_ms, plain_forward, setup

import torchlens as tl


def bert_base():
    import transformers

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig()).eval()
    ids = torch.randint(1000, 20000, (1, 8), generator=torch.Generator().manual_seed(0))
    return model, ids


def _feature_diff(out) -> torch.Tensor:
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[:, -1, 0] - hidden[:, -1, 1]


def _blocks(model):
    return model.encoder.layer if hasattr(model, "encoder") else model.transformer.h


def _hook_cell(model, ids, layer: int, p: int, donor: torch.Tensor):
    def pre(m, args, kwargs):
        x = (args[0] if args else kwargs["hidden_states"]).clone()
        x[:, p] = donor[:, p]
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    handle = _blocks(model)[layer].register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            return model(ids)
    finally:
        handle.remove()


def _donors(model, ids) -> dict[int, torch.Tensor]:
    donors = {}
    for layer, block in enumerate(_blocks(model)):
        seen = {}
        h = block.register_forward_pre_hook(
            lambda m, a, k, seen=seen: seen.update(v=(a[0] if a else k["hidden_states"]).clone()), with_kwargs=True)
        with torch.no_grad():
            model(ids)
        h.remove()
        donors[layer] = seen["v"]
    return donors


def grid_case(tool: str, case: str, model, clean_ids, corrupt_ids, metric, positions, rounds: int, *,
              hooks: bool = True, **options) -> dict:
    """The grid's per-cell cost (two traces included) over ``rounds`` runs, each against plain
    forwards timed right before and after it; ``ok``: sampled cells equal plain hooks to 1e-4.
    ``options`` go to ``activation_patching`` (``batched_cells=``, ``batch_size=``)."""
    base = plain_forward(model, clean_ids)
    layers = len(_blocks(model))
    cells = layers * len(positions)
    ratios, per_cell = [], []
    grid = None
    for _ in range(rounds):
        before = median_ms(base, 3)
        t0 = time.perf_counter()
        clean, corrupted = tl.trace(model, clean_ids), tl.trace(model, corrupt_ids)
        grid = tl.patching.activation_patching(clean, corrupted, metric, site="resid_pre", positions=positions,
                                               progress=False, **options)
        ms = (time.perf_counter() - t0) * 1000
        b = (before + median_ms(base, 3)) / 2
        ratios.append(ms / b / cells)
        per_cell.append(ms / cells)
    donors = _donors(model, clean_ids)
    sample = [(layer, positions[(3 * layer) % len(positions)]) for layer in range(layers)]
    ok = all(abs(float(metric(_hook_cell(model, corrupt_ids, layer, p, donors[layer])))
                 - float(grid.values[layer, positions.index(p)])) < 1e-4 for layer, p in sample)
    ratio = sorted(ratios)[len(ratios) // 2]
    ms = sorted(per_cell)[len(per_cell) // 2]
    decision = grid.notes["cells"]
    how = ("batched cells" if decision["batched"] and not decision["declined"] else "sliced forks") \
        + f" ({decision['reason']}{'; declined: ' + str(decision['declined']) if decision['declined'] else ''})"
    emit(tool, case, ms, ms / ratio, ok, f"{layers}x{len(positions)} cells, per-cell cost incl. 2 traces; "
         f"median of {rounds} grids, each over forwards timed around it; {how}; options {options}", ratio=ratio)
    if not hooks:
        return {"grid": grid}
    before = median_ms(base, 3)
    t0 = time.perf_counter()
    for layer, p in sample:
        _hook_cell(model, corrupt_ids, layer, p, donors[layer])
    hook_ms = (time.perf_counter() - t0) * 1000 / len(sample)
    b = (before + median_ms(base, 3)) / 2
    emit("plain_hooks", case, hook_ms, b, True, f"one hooked forward per cell (timed on {len(sample)} cells)")
    return {"grid": grid}


def _out_proj(model, layer: int):
    block = _blocks(model)[layer]
    return block.attention.output.dense if hasattr(block, "attention") else block.attn.c_proj


def _head_cell(model, ids, layer: int, head: int, p: int | None, donor: torch.Tensor, head_dim: int):
    """One head cell by hand: the clean head's slice (at position ``p``, or all) written into the
    output projection's input, as TransformerLens patches ``hook_z``."""
    cols = slice(head * head_dim, (head + 1) * head_dim)
    rows = slice(None) if p is None else slice(p, p + 1)

    def pre(m, args):
        x = args[0].clone()
        x[:, rows, cols] = donor[:, rows, cols]
        return (x,)

    handle = _out_proj(model, layer).register_forward_pre_hook(pre)
    try:
        with torch.no_grad():
            return model(ids)
    finally:
        handle.remove()


def heads_case(case: str, model, clean_ids, corrupt_ids, metric, positions, rounds: int) -> None:
    """Head grids batched and as sliced forks, alternately in this process (``rounds`` each), each
    grid timed against plain forwards right before and after it (two traces included)."""
    view = tl.arch(model)
    cells = view.n_layers * view.n_heads * (1 if positions is None else len(positions))
    base = plain_forward(model, clean_ids)
    got: dict[bool, list[float]] = {True: [], False: []}
    ms_of: dict[bool, list[float]] = {True: [], False: []}
    grids = {}
    for _ in range(rounds):
        for batched in (True, False):
            before = median_ms(base, 3)
            t0 = time.perf_counter()
            clean, corrupted = tl.trace(model, clean_ids), tl.trace(model, corrupt_ids)
            grids[batched] = tl.patching.activation_patching(clean, corrupted, metric, site="heads",
                                                             positions=positions, progress=False,
                                                             batched_cells=batched)
            ms = (time.perf_counter() - t0) * 1000
            b = (before + median_ms(base, 3)) / 2
            got[batched].append(ms / b / cells)
            ms_of[batched].append(ms / cells)
    donors = {}
    for layer in range(view.n_layers):
        seen = {}
        h = _out_proj(model, layer).register_forward_pre_hook(lambda m, a, seen=seen: seen.update(v=a[0].clone()))
        with torch.no_grad():
            model(clean_ids)
        h.remove()
        donors[layer] = seen["v"]
    at = [None] if positions is None else positions
    sample = [(layer, (5 * layer) % view.n_heads, (layer % len(at))) for layer in range(view.n_layers)]
    for batched in (True, False):
        grid = grids[batched]
        ok = all(abs(float(metric(_head_cell(model, corrupt_ids, layer, h, at[j], donors[layer], view.head_dim)))
                     - float(grid.values[(layer, h) if positions is None else (layer, h, j)])) < 1e-4
                 for layer, h, j in sample)
        ratio = sorted(got[batched])[len(got[batched]) // 2]
        ms = sorted(ms_of[batched])[len(ms_of[batched]) // 2]
        decision = grid.notes["cells"]
        emit("torchlens", f"{case}_{'batched' if batched else 'sliced'}", ms, ms / ratio, ok,
             f"{view.n_layers}x{view.n_heads}x{len(at)} head cells, per-cell cost incl. 2 traces; median of "
             f"{rounds} grids alternating batched/sliced, each over forwards timed around it; decision {decision}",
             ratio=ratio)


def heads_main(rounds: int) -> None:
    model, clean_ids, corrupt_ids = bert_prompts(8)
    heads_case("encoder_heads", model, clean_ids, corrupt_ids, _feature_diff, None, rounds)
    heads_case("encoder_heads_pos3", model, clean_ids, corrupt_ids, _feature_diff, [0, 3, 7], 1)
    model, clean_ids = gpt2_small()
    clean_ids = clean_ids[:, :8]
    corrupt_ids = clean_ids.clone()
    corrupt_ids[0, 5] = 4242
    with torch.no_grad():
        correct = int(model(clean_ids).logits[0, -1].argmax())
    metric = tl.patching.logit_diff(correct, (correct + 1) % 50257)
    heads_case("gpt2_heads_seq8", model, clean_ids, corrupt_ids, metric, None, rounds)
    heads_case("gpt2_heads_seq8_pos3", model, clean_ids, corrupt_ids, metric, [0, 3, 7], 1)


def _rome_cell(model, ids, subject, answer, noise, samples, seed, layer, p, clean_block) -> float:
    """ROME's ``trace_with_patch`` with plain hooks: noised embeddings (one row of draws per run,
    as ``causal_trace`` draws them), block ``layer``'s clean output at position ``p``."""
    view = tl.arch(model)
    draws = torch.randn(samples, len(subject), view.d_model, generator=torch.Generator().manual_seed(seed))

    def noised(m, a, out):
        out = out.clone()
        out[:, subject] += noise * draws
        return out

    def restore(m, a, out):
        first = (out[0] if isinstance(out, tuple) else out).clone()
        first[:, p] = clean_block[0, p]
        return (first, *out[1:]) if isinstance(out, tuple) else first

    handles = [view.module("embed").register_forward_hook(noised),
               view.module(f"blocks.{layer}").register_forward_hook(restore)]
    try:
        with torch.no_grad():
            logits = model(ids.repeat(samples, 1)).logits
    finally:
        for h in handles:
            h.remove()
    return float(logits[:, -1].softmax(-1)[:, answer].mean())


def causal_trace_case(case: str, model, ids) -> None:
    """causal_trace batched and as sliced forks (one run each, batched first), each timed against
    plain forwards right before and after it (its clean and noised traces included)."""
    view = tl.arch(model)
    subject, samples, seed = [1, 2], 3, 0
    cells = view.n_layers * ids.shape[1] * samples
    base = plain_forward(model, ids)
    runs = {}
    for batched in (True, False):
        before = median_ms(base, 3)
        t0 = time.perf_counter()
        result = tl.patching.causal_trace(model, ids, subject, kinds=("resid_post",), samples=samples, seed=seed,
                                          progress=False, batched_cells=batched)["resid_post"]
        ms = (time.perf_counter() - t0) * 1000
        runs[batched] = (result, ms, (before + median_ms(base, 3)) / 2)
    clean = {}
    for layer in range(view.n_layers):
        h = view.module(f"blocks.{layer}").register_forward_hook(
            lambda m, a, o, layer=layer: clean.update({layer: (o[0] if isinstance(o, tuple) else o).clone()}))
        with torch.no_grad():
            model(ids)
        h.remove()
    for batched, (result, ms, b) in runs.items():
        answer, noise = result.notes["answer"], result.notes["noise"]
        ok = all(abs(_rome_cell(model, ids, subject, answer, noise, samples, seed, layer, p, clean[layer])
                     - float(result.values[layer, p])) < 1e-4
                 for layer, p in [(layer, (3 * layer) % ids.shape[1]) for layer in range(0, view.n_layers, 3)])
        emit("torchlens", f"{case}_{'batched' if batched else 'sliced'}", ms / cells, b, ok,
             f"{view.n_layers}x{ids.shape[1]} cells x {samples} noised runs, per cell and run incl. traces; "
             f"decision {result.notes['cells']}", ratio=ms / cells / b)


def causal_trace_main() -> None:
    import transformers

    torch.manual_seed(0)
    mlm = transformers.BertForMaskedLM(transformers.BertConfig()).eval()
    causal_trace_case("encoder_causal_trace", mlm, bert_prompts(8)[1])
    causal_trace_case("gpt2_causal_trace_seq8", gpt2_small()[0], gpt2_small()[1][:, :8])


def bert_prompts(seq: int):
    model, clean_ids = bert_base()
    clean_ids = torch.randint(1000, 20000, (1, seq), generator=torch.Generator().manual_seed(0))
    corrupt_ids = clean_ids.clone()
    corrupt_ids[0, 2], corrupt_ids[0, 5] = 777, 4242
    return model, clean_ids, corrupt_ids


def main() -> None:
    setup()
    quick = "--quick" in sys.argv
    rounds = 1 if quick else 3
    if "--causal-trace" in sys.argv:
        causal_trace_main()
        return
    if "--whole-row" in sys.argv:
        whole_row_main()
        return
    if "--heads" in sys.argv:
        heads_main(1)  # one grid each way per case: the sliced head grids of BERT-base take a minute
        return
    model, clean_ids, corrupt_ids = bert_prompts(8)
    grid_case("torchlens", "encoder_grid", model, clean_ids, corrupt_ids, _feature_diff, list(range(8)), rounds)
    grid_case("torchlens", "encoder_grid_sliced", model, clean_ids, corrupt_ids, _feature_diff, list(range(8)),
              rounds, hooks=False, batched_cells=False)
    if "--sweep" in sys.argv:  # the batch size, and the prompt length where batching stops winning
        for k in (2, 4):
            grid_case("torchlens", f"encoder_grid_k{k}", model, clean_ids, corrupt_ids, _feature_diff,
                      list(range(8)), rounds, hooks=False, batched_cells=True, batch_size=k)
        for seq in (32, 64):
            model, clean_ids, corrupt_ids = bert_prompts(seq)
            for batched in (True, False):
                grid_case("torchlens", f"encoder_grid_seq{seq}_{'batched' if batched else 'sliced'}", model,
                          clean_ids, corrupt_ids, _feature_diff, list(range(0, seq, seq // 8)), 1, hooks=False,
                          batched_cells=batched)
    if "--encoder-only" in sys.argv:
        return
    model, clean_ids = gpt2_small()
    corrupt_ids = clean_ids.clone()
    corrupt_ids[0, 20], corrupt_ids[0, 40] = 777, 4242
    with torch.no_grad():
        correct = int(model(clean_ids).logits[0, -1].argmax())
        wrong = int(model(corrupt_ids).logits[0, -1].argmax())
    metric = tl.patching.logit_diff(correct, wrong if wrong != correct else (correct + 1) % 50257)
    grid_case("torchlens", "gpt2_grid_quick", model, clean_ids, corrupt_ids, metric, list(range(0, 64, 8)), 1)
    if "--sweep" in sys.argv:
        grid_case("torchlens", "gpt2_grid_quick_batched", model, clean_ids, corrupt_ids, metric,
                  list(range(0, 64, 8)), 1, hooks=False, batched_cells=True)
        short_clean, short_corrupt = clean_ids[:, :8], corrupt_ids[:, :8].clone()
        short_corrupt[0, 5] = 4242
        for batched in (True, False):
            grid_case("torchlens", f"gpt2_grid_seq8_{'batched' if batched else 'sliced'}", model, short_clean,
                      short_corrupt, metric, list(range(8)), 1, hooks=not batched, batched_cells=batched)


def whole_row_main() -> None:
    """GPT-2 small (causal) grids whose metric reads the whole output row (the correct token's
    probability: a softmax over the vocabulary, no partial read), 8 and 16 tokens, batched cells
    against sliced forks, alternately: ``tl.patching.CAUSAL_BATCHED_TOKENS``'s rule."""
    model, ids = gpt2_small()
    for seq in (8, 16, 32):
        clean_ids, corrupt_ids = ids[:, :seq], ids[:, :seq].clone()
        corrupt_ids[0, seq // 2] = 4242
        with torch.no_grad():
            correct = int(model(clean_ids).logits[0, -1].argmax())

        def prob(out, correct=correct):
            return out.logits[0, -1].softmax(-1)[correct]

        for batched in (True, False):
            grid_case("torchlens", f"gpt2_grid_prob_seq{seq}_{'batched' if batched else 'sliced'}", model, clean_ids,
                      corrupt_ids, prob, list(range(seq)) if seq <= 8 else list(range(0, seq, seq // 8)), 1,
                      hooks=False, batched_cells=batched)


if __name__ == "__main__":
    main()
