"""Batched cells (``torchlens.edit._cells``): a patching grid's cells of one site replayed as the
entries of one batch equal the sliced forks' grid and plain-hooks re-executions; the grid records
whether it batched, and a layer the batch cannot take is declined with its reason.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import LinearThen, SelectPoolNet, _seeded, build_tiny_bert_mlm, build_tiny_gpt2, refused
from test_patching import _baukit_causal_trace, _corrupt, _patched, _read

import torchlens as tl
from torchlens.edit import _cells
from torchlens.edit._cells import plan_cells, run_cells
from torchlens.edit._fallbacks import STRICT_ENV
from torchlens.errors import InvalidArgumentError, ReplayFallbackError, ReplayFellBack

EXACT = 1e-6  # batched against sliced, relative to the output's largest entry: float32 rounding of the same ops
ATOL = 1e-5  # against a re-executed forward (tests/test_patching.py)


def _feature(out) -> torch.Tensor:
    """A metric reading the whole output (no declared reads): two features of the last position."""
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits
    return hidden[:, -1, 0].sum() - hidden[:, -1, 1].sum()


def _same(batched, sliced, trace) -> bool:
    """The two grids agree to :data:`EXACT` of the model output's scale (the metrics read the output)."""
    out = trace.output
    scale = float((out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits).abs().max())
    return float((batched.values - sliced.values).abs().max()) <= EXACT * max(1.0, scale)


def _grids(clean, corrupted, metric, site, **kwargs):
    batched = tl.patching.activation_patching(clean, corrupted, metric, site=site, batched_cells=True, **kwargs)
    sliced = tl.patching.activation_patching(clean, corrupted, metric, site=site, batched_cells=False, **kwargs)
    assert batched.notes["cells"] == {"batched": True, "reason": "batched_cells=True", "declined": {}}
    assert sliced.notes["cells"]["batched"] is False
    return batched, sliced


def _one_prompt(minilm):
    kwargs = {k: v[1:] for k, v in minilm.kwargs.items()}  # the unpadded prompt, batch 1
    corrupted = dict(kwargs, input_ids=_corrupt(kwargs["input_ids"], 3, 2748))
    return tl.trace(minilm.model, **kwargs), tl.trace(minilm.model, **corrupted), kwargs, corrupted


def test_encoder_grid_is_batched_by_default_and_equals_sliced_forks_and_plain_hooks(minilm):
    model = minilm.model
    clean, corrupted, kwargs, bad = _one_prompt(minilm)
    auto = tl.patching.activation_patching(clean, corrupted, _feature)
    assert auto.notes["cells"] == {"batched": True, "reason": "7 tokens <= 32; attention is bidirectional",
                                   "declined": {}}
    batched, sliced = _grids(clean, corrupted, _feature, "resid_pre")
    assert torch.equal(auto.values, batched.values)
    assert _same(batched, sliced, corrupted)
    for layer in range(tl.arch(model).n_layers):  # a sample of cells, each one hooked forward (no padding: no mask)
        p = (2 * layer + 1) % 7
        donor = _read(model, kwargs["input_ids"], "resid_pre", layer)
        want = float(_feature(_patched(model, bad["input_ids"], "resid_pre", layer, p, donor)))
        assert abs(float(batched.values[layer, p]) - want) < ATOL, (layer, p)


def test_every_site_kind_and_a_padded_batch_equal_sliced_forks(minilm):
    clean, corrupted, _, _ = _one_prompt(minilm)
    for site in ("resid_mid", "resid_post", "attn", "mlp"):
        batched, sliced = _grids(clean, corrupted, _feature, site)
        assert _same(batched, sliced, corrupted), site
    # two prompts, the first padded (attention mask): every cell restores both prompts' row
    bad = dict(minilm.kwargs, input_ids=_corrupt(minilm.kwargs["input_ids"], 3, 2748))
    corrupted = tl.trace(minilm.model, **bad)
    batched, sliced = _grids(tl.trace(minilm.model, **minilm.kwargs), corrupted, _feature, "resid_pre",
                             batch_size=3)  # chunks of 3 cells: 7 positions in three batches
    assert _same(batched, sliced, corrupted)


def test_causal_grid_stays_sliced_by_default_and_forced_batches_equal_it(tiny_gpt2):
    model, clean_ids = tiny_gpt2.model, tiny_gpt2.args[0]
    corrupt_ids = _corrupt(clean_ids, 2, 11)
    clean, corrupted = tl.trace(model, clean_ids), tl.trace(model, corrupt_ids)
    logit_diff = tl.patching.logit_diff(int(clean_ids[0, 3]), 11)
    auto = tl.patching.activation_patching(clean, corrupted, logit_diff)
    assert auto.notes["cells"] == {"batched": False, "reason": "6 tokens <= 32; attention is causal", "declined": {}}
    for metric in (logit_diff, _feature):  # the LM head's two logits alone, and the whole output (with its cache)
        for site in ("resid_pre", "attn", "mlp"):
            batched, sliced = _grids(clean, corrupted, metric, site)
            assert _same(batched, sliced, corrupted), (metric, site)
    batched = _grids(clean, corrupted, logit_diff, "resid_pre")[0]
    # before the corrupted position both runs agree (causal attention): those cells are the corrupted run itself
    assert torch.all(batched.values[:, :2] == batched.corrupted)
    for layer in range(2):
        donor = _read(model, clean_ids, "resid_pre", layer)
        for p in range(clean_ids.shape[1]):
            want = float(logit_diff(_patched(model, corrupt_ids, "resid_pre", layer, p, donor)))
            assert abs(float(batched.values[layer, p]) - want) < ATOL, (layer, p)


def test_long_prompts_stay_sliced(tiny_gpt2):
    ids = tiny_gpt2.args[0].repeat(6, 1)  # six prompts of 6 tokens: counted together
    trace = tl.trace(tiny_gpt2.model, ids)
    result = tl.patching.activation_patching(trace, trace, _feature, layers=[1], positions=[0])
    assert result.notes["cells"] == {"batched": False, "reason": "36 tokens > 32", "declined": {}}


@pytest.mark.parametrize(("read", "reason"), [(lambda t: t.sum(), "branched on a value the edit reaches"),
                                              (lambda t: t.abs().max(), "is a guard")])
def test_a_guard_the_edit_reaches_declines_the_batch_with_its_reason(read, reason, monkeypatch):
    model = build_tiny_gpt2()

    def guard(module, args, out):  # the forward branches on block 0's attention output
        if bool(read(out[0]) > 1e9):
            raise AssertionError("unreachable")

    handle = model.transformer.h[0].attn.register_forward_hook(guard)
    try:
        ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
        clean, corrupted = tl.trace(model, ids), tl.trace(model, _corrupt(ids, 2, 11))
    finally:
        handle.remove()
    result = tl.patching.activation_patching(clean, corrupted, _feature, batched_cells=True)
    declined = result.notes["cells"]["declined"]
    assert list(declined) == [0] and reason in declined[0]  # block 1's cells start after it: batched
    monkeypatch.setenv(STRICT_ENV, "1")  # a declared fallback raises, with its reason
    with pytest.raises(ReplayFallbackError, match=reason):
        tl.patching.activation_patching(clean, corrupted, _feature, batched_cells=True)
    monkeypatch.delenv(STRICT_ENV)
    sliced = tl.patching.activation_patching(clean, corrupted, _feature, batched_cells=False)
    assert _same(result, sliced, corrupted)


def test_in_place_writes_are_declared_before_running(inplace_net):
    trace = tl.trace(inplace_net.model, *inplace_net.args)
    trace.ensure_graph()
    first = next(op for op in trace.ops if not op.is_input)
    why = plan_cells(trace, first)
    assert isinstance(why, str) and ("in place" in why or "through views" in why)


def test_bad_batched_cells_raises_a_named_error_and_changes_nothing(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    err = refused(model, lambda: tl.patching.activation_patching(
        ids, ids, _feature, model=model, batched_cells="yes"), InvalidArgumentError)
    assert "batched_cells" in str(err)
    err = refused(model, lambda: tl.patching.causal_trace(model, ids, [1], batched_cells=1), InvalidArgumentError)
    assert "batched_cells" in str(err)


def test_a_cells_whole_output_holds_its_own_kv_cache(tiny_gpt2):
    """A metric of the whole output sees the cell's cache (an object the output holds), as the sliced fork's."""
    model, clean_ids = tiny_gpt2.model, tiny_gpt2.args[0]
    clean, corrupted = tl.trace(model, clean_ids), tl.trace(model, _corrupt(clean_ids, 2, 11))
    corrupted.ensure_graph()
    cells = plan_cells(corrupted, corrupted.bind("blocks.0.resid_pre").match(corrupted)[0])
    edit = tl.patching.restore_rows(clean["blocks.0.resid_pre"].out, 2)
    got = run_cells(corrupted, [cells], [[edit(corrupted.value(cells.site), ctx=None)]], [["cell"]])[0][0]
    want = corrupted.fork().do("blocks.0.resid_pre", edit).output  # the sliced fork
    assert torch.allclose(got.logits, want.logits, atol=EXACT)
    for mine, theirs in zip(got.past_key_values.layers, want.past_key_values.layers):
        assert torch.allclose(mine.keys, theirs.keys, atol=EXACT) and torch.allclose(mine.values, theirs.values,
                                                                                      atol=EXACT)
    assert not torch.equal(got.past_key_values.layers[1].keys, corrupted.output.past_key_values.layers[1].keys)


def _select_pool(how: str):
    """The :class:`SelectPoolNet` of ``how`` with a clean and a corrupted input (position 2 changed)."""
    model = _seeded(lambda: SelectPoolNet(how))
    x = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(1))
    bad = x.clone()
    bad[0, 2] += 1.5
    return model, x, bad


def _head_diff(out) -> torch.Tensor:
    return out[0, -1, 0] - out[0, -1, 1]


def _hooked_grid(model, x, bad) -> torch.Tensor:
    """Every cell by hand: a forward hook writing block ``layer``'s clean row ``p`` into its output."""
    blocks = model.blocks
    clean = {}
    hooks = [b.register_forward_hook(lambda m, a, o, i=i: clean.update({i: o.clone()})) for i, b in enumerate(blocks)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    grid = torch.empty(len(blocks), x.shape[1])
    for layer, block in enumerate(blocks):
        for p in range(x.shape[1]):
            def write(m, a, o, layer=layer, p=p):
                o = o.clone()
                o[:, p] = clean[layer][:, p]
                return o

            h = block.register_forward_hook(write)
            with torch.no_grad():
                grid[layer, p] = _head_diff(model(bad))
            h.remove()
    return grid


def _declined_grid(how: str, reason: str, monkeypatch, op: str = "") -> None:
    """The grid over the three blocks' outputs of ``SelectPoolNet(how)``: blocks 0 and 1 declined with
    ``reason`` naming ``op`` (block 2's output reaches only the head), batched and sliced grids equal to plain forward
    hooks, and strict fallbacks raising with the reason."""
    model, x, bad = _select_pool(how)
    clean, corrupted = tl.trace(model, x), tl.trace(model, bad)
    batched = tl.patching.activation_patching(clean, corrupted, _head_diff, site="resid_post", batched_cells=True)
    sliced = tl.patching.activation_patching(clean, corrupted, _head_diff, site="resid_post", batched_cells=False)
    declined = batched.notes["cells"]["declined"]
    assert sorted(declined) == [0, 1], declined
    assert all(reason in why and op in why for why in declined.values()), declined
    want = _hooked_grid(model, x, bad)
    assert torch.allclose(batched.values, want, atol=ATOL) and torch.allclose(sliced.values, want, atol=ATOL)
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(ReplayFallbackError, match=re.escape(reason)):
        tl.patching.activation_patching(clean, corrupted, _head_diff, site="resid_post", batched_cells=True)


@pytest.mark.parametrize(("how", "op"), [("mask", "(getitem) at"), ("nonzero", "(nonzero) at")])
def test_an_op_whose_shape_depends_on_the_values_is_declined_before_running(how, op, monkeypatch):
    """Boolean-mask indexing (``h[h > 0]``) or nonzero downstream of a site: each cell would select
    another number of elements, so its cells replay as forks."""
    _declined_grid(how, "returns a shape that depends on values the edit reaches (it "
                   + ("selects elements by a boolean mask: x[mask]" if how == "mask" else "lists or counts the input's "
                      "elements") + "), which can differ from cell to cell", monkeypatch, op)


def test_an_lstm_is_declined_before_running(monkeypatch):
    """``nn.LSTM`` downstream of a site: vmap has no batching rule for its fused kernel (nor a fallback),
    so those cells replay as forks."""
    model, x, bad = _select_pool("lstm")
    trace = tl.trace(model, bad)
    trace.ensure_graph()
    lstm = next(op for op in trace.ops if op.func_name == "lstm" and op.module.startswith("blocks.1"))
    why = plan_cells(trace, trace.bind("blocks.0", strings_as_modules=True).match(trace)[0])
    assert why == f"op {lstm.label} (lstm) at {lstm.source} has no batching rule in torch.vmap (a recurrent " \
                  "layer's fused kernel)"
    with pytest.raises(RuntimeError, match="Batching rule not implemented for aten::lstm"):  # what it spares
        torch.vmap(lambda h: model.blocks[1].rnn(h)[0])(torch.stack([trace.value(lstm.parent_refs[0].index)] * 2))
    # its cells replay as forks (the sweep stacks the LSTM's outputs): both grids equal plain hooks; strict raises
    _declined_grid("lstm", "has no batching rule in torch.vmap (a recurrent layer's fused kernel)", monkeypatch,
                   "(lstm) at")


_SHAPE = "returns a shape that depends on values the edit reaches ({}), which can differ from cell to cell"
_MASK, _LISTS = _SHAPE.format("it selects elements by a boolean mask: x[mask]"), _SHAPE.format(
    "it lists or counts the input's elements")
F = torch.nn.functional


@pytest.mark.parametrize(("then", "op", "why"), [
    (lambda h: h[h > 0].sum(), "getitem", _MASK),
    (lambda h: torch.masked_select(h, h > 0).sum(), "masked_select", _MASK),
    (lambda h: torch.index_put(h, (h > 0,), torch.tensor(1.0)).sum(), "index_put", _MASK),
    (lambda h: torch.nonzero(h > 0).sum(), "nonzero", _LISTS),
    (lambda h: (h > 0).nonzero(as_tuple=True)[0].sum(), "nonzero", _LISTS),
    (lambda h: torch.argwhere(h > 0).sum(), "argwhere", _LISTS),
    (lambda h: torch.where(h > 0)[0].sum(), "where",
     _SHAPE.format("one-argument where lists the input's nonzero elements")),
    (lambda h: torch.unique(h.round()).sum(), "unique", _LISTS),
    (lambda h: torch.unique_consecutive(h.round()).sum(), "unique_consecutive", _LISTS),
    (lambda h: torch.repeat_interleave(h[0], (h[1] > 0).long() + 1).sum(), "repeat_interleave",
     _SHAPE.format("the repeat counts")),
    (lambda h: torch.bincount((h[0] > 0).long() * 3).sum(), "bincount",
     _SHAPE.format("its length is the largest value + 1")),
    (lambda h: F.one_hot((h[0] > 0).long() * 2).sum(), "one_hot",
     _SHAPE.format("one_hot without num_classes: its width is the largest class + 1")),
    (lambda h: torch.tensor_split(h, torch.tensor([1]))[0].sum(), "tensor_split",
     "has no batching rule in torch.vmap (split at a tensor of indices)"),
    (lambda h: h.narrow(0, torch.tensor(1), 1).sum(), "narrow", "has no batching rule in torch.vmap (a tensor start)"),
])
def test_plan_cells_declines_each_op_vmap_refuses_by_name(then, op, why):
    """Each op downstream of the site is declined with its reason, and torch.vmap does refuse it on two
    cells (one whose values are all positive, one all negative)."""
    trace = tl.trace(_seeded(lambda: LinearThen(then)), torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
    trace.ensure_graph()
    site = next(o for o in trace.ops if o.func_name == "linear")
    record = next(o for o in trace.ops if o.func_name == op)
    assert plan_cells(trace, site) == f"op {record.label} ({op}) at {record.source} {why}"
    with pytest.raises(RuntimeError):
        torch.vmap(then)(torch.stack([site.out.abs() + 1, -site.out.abs() - 1]))


@pytest.mark.parametrize(("then", "read"), [(lambda h: h.sum() * sum(h[0].tolist()), "tolist"),
                                            (lambda h: h.sum() * float(h.mean()), "float")])
def test_a_read_into_python_the_edit_reaches_is_declined_and_forks_re_execute(then, read):
    """``tolist()`` / ``float()`` of a value the edit reaches: a guard each cell checks alone (vmap cannot
    read a batch into Python); the fork, whose read changes, re-executes and equals a plain forward hook."""
    model = _seeded(lambda: LinearThen(then))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    trace = tl.trace(model, x)
    trace.ensure_graph()
    why = plan_cells(trace, next(o for o in trace.ops if o.func_name == "linear"))
    assert isinstance(why, str) and f"the forward branched on a value the edit reaches ({read}() at" in why
    with pytest.warns(ReplayFellBack, match=f"{read}\\(\\)"):
        got = trace.fork().do("fc", lambda a, *, ctx: a * 2).output
    handle = model.fc.register_forward_hook(lambda m, a, o: o * 2)
    with torch.no_grad():
        want = model(x)
    handle.remove()
    assert torch.allclose(got, want, atol=ATOL)


def test_a_vmap_refusal_while_running_declines_the_layers_it_reaches(monkeypatch):
    """The safety net: with the boolean-mask rule taken out of plan_cells, vmap itself refuses ``h[h > 0]``
    while the batch runs; the layers whose cells reach it replay as forks, with vmap's words."""
    monkeypatch.setattr(_cells, "_VMAP_LIMITS", {k: v for k, v in _cells._VMAP_LIMITS.items() if k != "getitem"})
    _declined_grid("mask", "vmap: We do not support batching operators that can support dynamic shape. "
                           "Attempting to batch over indexing with a boolean mask.", monkeypatch)


def test_a_constant_mask_stays_batched(monkeypatch):
    """``h[..., keep]`` with a mask the edit does not reach selects as many elements in every cell: batched."""
    model, x, bad = _select_pool("fixed_mask")
    monkeypatch.setenv(STRICT_ENV, "1")  # no fallback anywhere
    got = tl.patching.activation_patching(x, bad, _head_diff, model=model, site="resid_post", batched_cells=True)
    assert got.notes["cells"]["declined"] == {}
    assert torch.allclose(got.values, _hooked_grid(model, x, bad), atol=ATOL)


def test_run_cells_hands_back_only_vmap_refusals(monkeypatch):
    """While the batch runs, a RuntimeError of vmap's (batching rules) declines the sites reaching its op;
    any other error propagates."""
    model, x, bad = _select_pool("fixed_mask")
    trace = tl.trace(model, bad)
    trace.ensure_graph()
    sites = [trace.bind(f"blocks.{i}", strings_as_modules=True).match(trace)[0] for i in range(3)]
    passes = [plan_cells(trace, s) for s in sites]
    tanh = next(op for op in passes[1].ops if op.func_name == "tanh")  # in block 2: sites 0 and 1 reach it
    values = [[trace.value(c.site) * 2] for c in passes]
    names = [["a"], ["b"], ["c"]]

    def refuse(*args, **kwargs):
        raise RuntimeError("Batching rule not implemented for aten::tanh. We could not generate a fallback.")

    monkeypatch.setattr(tanh, "func", refuse)
    got = run_cells(trace, passes, values, names)
    assert got[0] == got[1] == (f"torch.vmap could not batch op {tanh.label} (tanh) at {tanh.source}: "
                                "Batching rule not implemented for aten::tanh. We could not generate a fallback.")
    want = trace.fork().do("blocks.2", lambda a, *, ctx: a * 2).output  # the third site still ran, batched
    assert torch.allclose(got[2][0], want, atol=EXACT)

    def boom(*args, **kwargs):
        raise RuntimeError("the model's own error")

    monkeypatch.setattr(tanh, "func", boom)
    with pytest.raises(RuntimeError, match="the model's own error"):
        run_cells(trace, passes, values, names)


def _z(model, kwargs: dict) -> dict[int, torch.Tensor]:
    """Per layer, the heads' concatenated outputs (TransformerLens' ``hook_z``): the output projection's input."""
    seen = {}
    hooks = [b.attention.output.dense.register_forward_pre_hook(lambda m, a, i=i: seen.update({i: a[0].clone()}))
             for i, b in enumerate(model.encoder.layer)]
    with torch.no_grad():
        model(**kwargs)
    for h in hooks:
        h.remove()
    return seen


def _z_patched(model, kwargs: dict, layer: int, head: int, p: int | None, donor: torch.Tensor):
    """The forward with head ``head``'s slice of layer ``layer``'s z (at position ``p``, or all) from ``donor``."""
    d = model.config.hidden_size // model.config.num_attention_heads
    rows = slice(None) if p is None else slice(p, p + 1)

    def write(m, a):
        z = a[0].clone()
        z[:, rows, head * d:(head + 1) * d] = donor[:, rows, head * d:(head + 1) * d]
        return (z,)

    h = model.encoder.layer[layer].attention.output.dense.register_forward_pre_hook(write)
    try:
        with torch.no_grad():
            return model(**kwargs)
    finally:
        h.remove()


@pytest.mark.parametrize("positions", [None, [1, 6]])
def test_encoder_head_grids_are_batched_and_equal_sliced_forks_and_hooked_z(minilm, positions):
    """Each layer's head cells edit one site (the attention op's per-head output) as batch entries."""
    model = minilm.model
    clean, corrupted, kwargs, bad = _one_prompt(minilm)
    auto = tl.patching.activation_patching(clean, corrupted, _feature, site="heads", positions=positions)
    assert auto.notes["cells"] == {"batched": True, "reason": "7 tokens <= 32; attention is bidirectional",
                                   "declined": {}}
    sliced = tl.patching.activation_patching(clean, corrupted, _feature, site="heads", positions=positions,
                                             batched_cells=False)
    assert sliced.notes["cells"]["batched"] is False
    assert auto.values.shape == sliced.values.shape and _same(auto, sliced, corrupted)
    donors, view = _z(model, kwargs), tl.arch(model)
    at = [None] if positions is None else positions
    for layer in range(view.n_layers):  # a sample of cells, each a hooked forward
        h, j = (5 * layer + 1) % view.n_heads, layer % len(at)
        want = float(_feature(_z_patched(model, bad, layer, h, at[j], donors[layer])))
        got = auto.values[layer, h] if positions is None else auto.values[layer, h, j]
        assert abs(float(got) - want) < ATOL, (layer, h, at[j])


def test_causal_grid_whose_metric_reads_the_whole_row_batches_on_short_prompts(tiny_gpt2):
    """Through causal attention a metric with no partial read (every sliced cell would read the LM
    head whole) batches on prompts of at most CAUSAL_BATCHED_TOKENS tokens; equal to the sliced
    grid and to plain hooks; a longer prompt stays sliced."""
    model, clean_ids = tiny_gpt2.model, tiny_gpt2.args[0]
    corrupt_ids = _corrupt(clean_ids, 2, 11)
    clean, corrupted = tl.trace(model, clean_ids), tl.trace(model, corrupt_ids)

    def prob(out):
        return out.logits[0, -1].softmax(-1)[int(clean_ids[0, 3])]

    auto = tl.patching.activation_patching(clean, corrupted, prob)
    assert auto.notes["cells"] == {"batched": True, "reason": "6 tokens <= 32; attention is causal, but the metric "
                                   "reads the whole output row and 6 tokens <= 16", "declined": {}}
    sliced = tl.patching.activation_patching(clean, corrupted, prob, batched_cells=False)
    assert _same(auto, sliced, corrupted)
    donor = _read(model, clean_ids, "resid_pre", 1)
    for p in range(clean_ids.shape[1]):
        want = float(prob(_patched(model, corrupt_ids, "resid_pre", 1, p, donor)))
        assert abs(float(auto.values[1, p]) - want) < ATOL, p
    declared = tl.patching.activation_patching(clean, corrupted, tl.patching.prob(int(clean_ids[0, 3])))
    assert declared.notes["cells"]["batched"] is True  # its declared read is the whole last row
    assert torch.allclose(declared.values, auto.values, atol=1e-6)
    ids = clean_ids.repeat(3, 1)  # three prompts of 6 tokens: 18 > 16
    longer = tl.patching.activation_patching(tl.trace(model, ids), tl.trace(model, _corrupt(ids, 2, 11)),
                                             lambda out: out.logits[:, -1].softmax(-1)[:, 3].sum())
    assert longer.notes["cells"]["batched"] is False and longer.notes["cells"]["reason"] == \
        "18 tokens <= 32; attention is causal"


def test_causal_head_grids_stay_sliced_by_default_and_forced_batches_equal_them(tiny_gpt2):
    model, clean_ids = tiny_gpt2.model, tiny_gpt2.args[0]
    clean, corrupted = tl.trace(model, clean_ids), tl.trace(model, _corrupt(clean_ids, 2, 11))
    logit_diff = tl.patching.logit_diff(int(clean_ids[0, 3]), 11)
    for positions in (None, [0, 3]):
        auto = tl.patching.activation_patching(clean, corrupted, logit_diff, site="heads", positions=positions)
        assert auto.notes["cells"] == {"batched": False, "reason": "6 tokens <= 32; attention is causal",
                                       "declined": {}}
        forced = tl.patching.activation_patching(clean, corrupted, logit_diff, site="heads", positions=positions,
                                                 batched_cells=True)
        assert forced.notes["cells"] == {"batched": True, "reason": "batched_cells=True", "declined": {}}
        assert _same(forced, auto, corrupted), positions


def test_causal_trace_on_an_encoder_is_batched_and_equals_sliced_forks_and_baukit_style_hooks():
    """ROME's causal tracing on a bidirectional masked LM: each noised run's cells are batched."""
    model, ids, subject = build_tiny_bert_mlm(), torch.tensor([[1, 5, 9, 13, 17, 21]]), [1, 2]
    batched = tl.patching.causal_trace(model, ids, subject, samples=2, seed=3)
    sliced = tl.patching.causal_trace(model, ids, subject, samples=2, seed=3, batched_cells=False)
    for kind, result in batched.items():
        assert result.notes["cells"] == {"batched": True, "declined": {}, "reason": (
            "6 tokens <= 32; causal tracing batches through causal attention too (measured)")}
        assert sliced[kind].notes["cells"]["batched"] is False
        assert float((result.values - sliced[kind].values).abs().max()) <= EXACT, kind
        answer, noise = result.notes["answer"], result.notes["noise"]
        for layer in range(2):
            clean_value = _read(model, ids, kind, layer)
            for p in range(ids.shape[1]):
                want = _baukit_causal_trace(model, ids, subject, answer, noise, 2, 3, kind, layer, p, clean_value)
                assert abs(float(result.values[layer, p]) - want) < ATOL, (kind, layer, p)


def test_causal_trace_on_a_causal_lm_is_batched_too_and_windows_say_why_they_are_not(tiny_gpt2, monkeypatch):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    auto = tl.patching.causal_trace(model, ids, [1, 2], kinds=["mlp"], samples=2)["mlp"]
    assert auto.notes["cells"] == {"batched": True, "declined": {},
                                   "reason": "6 tokens <= 32; causal tracing batches through causal attention too "
                                             "(measured)"}
    sliced = tl.patching.causal_trace(model, ids, [1, 2], kinds=["mlp"], samples=2, batched_cells=False)["mlp"]
    assert sliced.notes["cells"] == {"batched": False, "reason": "batched_cells=False", "declined": {}}
    assert float((sliced.values - auto.values).abs().max()) <= EXACT
    clean_value = _read(model, ids, "mlp", 1)
    for p in range(ids.shape[1]):  # the last block's cells, each one ROME trace_with_patch with plain hooks
        want = _baukit_causal_trace(model, ids, [1, 2], auto.notes["answer"], auto.notes["noise"], 2, 1, "mlp", 1, p,
                                    clean_value)
        assert abs(float(auto.values[1, p]) - want) < ATOL, p
    why = "window=2: a cell restores 2 blocks, and a batch entry edits one site"
    windowed = tl.patching.causal_trace(model, ids, [1, 2], kinds=["mlp"], samples=2, window=2)["mlp"]
    assert windowed.notes["cells"] == {"batched": False, "reason": why, "declined": {}}
    monkeypatch.setenv(STRICT_ENV, "1")  # asked for and not possible: a declared fallback
    tl.patching.causal_trace(model, ids, [1, 2], kinds=["mlp"], samples=2, window=2)  # not asked for: no fallback
    with pytest.raises(ReplayFallbackError, match=why):
        tl.patching.causal_trace(model, ids, [1, 2], kinds=["mlp"], samples=2, window=2, batched_cells=True)
