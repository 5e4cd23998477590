"""Batched cells (``torchlens.edit._cells``): a patching grid's cells of one site replayed as the
entries of one batch equal the sliced forks' grid and plain-hooks re-executions; the grid records
whether it batched, and a layer the batch cannot take is declined with its reason.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_gpt2, refused
from test_patching import _corrupt, _patched, _read

import torchlens as tl
from torchlens.edit._cells import plan_cells, run_cells
from torchlens.edit._fallbacks import STRICT_ENV
from torchlens.errors import InvalidArgumentError, ReplayFallbackError

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
