"""tl.trace(..., features={site: sae}): dictionaries spliced in as recorded ops; reads, edits, replay, bad input.

References are plain forwards with a ``register_forward_hook`` doing the splice by hand, never TorchLens.
"""

from __future__ import annotations

import pytest
import torch
from conftest import LinearSAE, assert_model_clean, hook_state, saelens_sae

import torchlens as tl
from torchlens.errors import (
    EditNotAppliedError,
    FeatureDtypeError,
    FeatureIndexError,
    FeatureSiteError,
    FeatureWidthError,
    InvalidArgumentError,
    NotAFeatureDictionaryError,
)

pytest.importorskip("sae_lens")

SITE, REAL = "blocks.1", "transformer.h.1"
ATOL = 1e-5  # sliced replay recomputes rows: equal to float rounding, not bit for bit


@pytest.fixture(scope="module")
def gpt(tiny_gpt2):
    return tiny_gpt2.model, tiny_gpt2.args[0]


@pytest.fixture(scope="module", params=["standard", "jumprelu", "topk"])
def sae(request):
    extra = {"k": 6} if request.param == "topk" else {}
    return saelens_sae(request.param, d_in=32, d_sae=64, seed=4, **extra)


def block_out(model, ids, address=REAL):
    """The module output a plain forward hook sees."""
    seen = {}
    handle = model.get_submodule(address).register_forward_hook(lambda m, a, o: seen.setdefault("x", o.detach()))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    return seen["x"]


def spliced_logits(model, ids, sae, edit_features=None, *, use_error_term=True, add=None, address=REAL):
    """Logits of a plain forward whose ``address`` output is replaced by the splice done by hand."""

    def hook(module, args, out):
        f = sae.encode(out)
        clean = sae.decode(f)
        if edit_features is not None:
            f = edit_features(f.clone())
        new = sae.decode(f) if use_error_term is False else out + (sae.decode(f) - clean)
        return new + add if add is not None else new

    handle = model.get_submodule(address).register_forward_hook(hook)
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        handle.remove()


def plain_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


# -- exactness and reads -----------------------------------------------------------------------------------


def test_unedited_output_is_the_models_own_bit_for_bit(gpt, sae) -> None:
    model, ids = gpt
    before = hook_state(model)
    t = tl.trace(model, ids, features={SITE: sae})
    assert_model_clean(model, before)
    assert torch.equal(t.output.logits, plain_logits(model, ids))
    assert torch.equal(t[REAL].out, block_out(model, ids))


def test_reads_features_recon_error(gpt, sae) -> None:
    model, ids = gpt
    t = tl.trace(model, ids, features={SITE: sae})
    x = block_out(model, ids)
    with torch.no_grad():
        f = sae.encode(x)
        recon = sae.decode(f)
    assert torch.equal(t[f"{SITE}.features"].out, f)
    assert t[f"{SITE}.features"].label == t[f"{REAL}.features"].label == f"{REAL}.features"  # one op, two spellings
    assert torch.equal(t[f"{SITE}.recon"].out, recon)
    assert torch.equal(t[f"{SITE}.recon_clean"].out, recon)
    assert torch.equal(t[f"{SITE}.error"].out, x - recon)
    assert t[f"{SITE}.features"].module == REAL  # the dictionary's ops run inside the site's module call


def test_sparse_views(gpt, sae) -> None:
    model, ids = gpt
    t = tl.trace(model, ids, features={SITE: sae})
    f = t[f"{SITE}.features"].out[0, -1]
    top = tl.features.top(t, SITE, k=3)
    want = torch.topk(f, 3)
    assert torch.equal(top.values, want.values) and torch.equal(top.indices, want.indices)
    on = tl.features.active(t, SITE, position=2)
    row = t[f"{SITE}.features"].out[0, 2]
    assert sorted(on.indices.tolist()) == torch.nonzero(row).flatten().tolist()
    assert all(row[i] == v for i, v in on.tolist())
    assert list(on.values) == sorted(on.values.tolist(), reverse=True)


def test_every_layer_at_once(gpt) -> None:
    model, ids = gpt
    saes = {f"blocks.{i}": saelens_sae(d_in=32, d_sae=48, seed=10 + i) for i in range(2)}
    t = tl.trace(model, ids, features=saes)
    assert torch.equal(t.output.logits, plain_logits(model, ids))
    for i in range(2):
        x = block_out(model, ids, f"transformer.h.{i}")
        assert torch.equal(t[f"blocks.{i}.features"].out, saes[f"blocks.{i}"].encode(x).detach())


def test_plain_module_and_loaded_sae(gpt, tmp_path) -> None:
    model, ids = gpt
    torch.manual_seed(3)
    lin = LinearSAE(32, 40)
    t = tl.trace(model, ids, features={SITE: lin})
    assert torch.equal(t.output.logits, plain_logits(model, ids))
    assert torch.equal(t[f"{SITE}.features"].out, lin.encode(block_out(model, ids)).detach())
    saelens_sae(d_in=32, d_sae=40, seed=5).save_model(tmp_path)
    loaded = tl.features.load_sae(tmp_path)
    t = tl.trace(model, ids, features={REAL: loaded})
    assert torch.equal(t.output.logits, plain_logits(model, ids))
    assert torch.equal(t[f"{SITE}.features"].out, loaded.encode(block_out(model, ids)))


def test_extract_reads_sub_sites(gpt, sae) -> None:
    model, ids = gpt
    before = hook_state(model)
    keys = [f"{SITE}.features", f"{SITE}.recon", f"{SITE}.error", REAL]
    got = tl.extract(model, ids, keys, features={SITE: sae})  # module hooks serve it: no op recorded
    assert_model_clean(model, before)
    x = block_out(model, ids)
    with torch.no_grad():
        f = sae.encode(x)
        recon = sae.decode(f)
    assert torch.equal(got[f"{SITE}.features"], f)
    assert torch.equal(got[f"{SITE}.recon"], recon)
    assert torch.equal(got[f"{SITE}.error"], x - recon)
    assert torch.equal(got[REAL], x)
    # with an op site among the reads every op is recorded, and the sub-sites are ops of that capture
    mixed = tl.extract(model, ids, {"f": f"{SITE}.features", "ln": "layer_norm_1"}, features={SITE: sae})
    assert torch.equal(mixed["f"], f)
    with pytest.raises(tl.SiteNotFoundError) as err:  # a sub-site of a site no dictionary is attached to
        tl.extract(model, ids, ["blocks.0.features"], features={SITE: sae})
    assert f"{REAL}.features" in str(err.value)  # the nearest names show the attached one


def test_save_keeps_the_named_sub_site(gpt, sae) -> None:
    model, ids = gpt
    t = tl.trace(model, ids, features={SITE: sae}, save=[f"{SITE}.features"])
    assert torch.equal(t[f"{SITE}.features"].out, sae.encode(block_out(model, ids)).detach())


# -- edits: fork().do, tl.when, forks, patching, steering ------------------------------------------------




def _clamp_last(f):
    f[..., -1, [3, 7]] = 2.5
    return f


def test_fork_feature_edit_replays_sliced(gpt, sae) -> None:
    model, ids = gpt
    t = tl.trace(model, ids, features={SITE: sae})
    fork = t.fork().do(f"{SITE}.features", tl.features.clamp([3, 7], 2.5, positions=-1))
    want = spliced_logits(model, ids, sae, _clamp_last)
    assert torch.allclose(fork.output.logits, want, atol=ATOL)
    assert not torch.allclose(want, plain_logits(model, ids), atol=1e-3)  # the edit mattered
    applied = fork.edits[-1]
    assert applied.how == "replayed"  # no fallback to re-executing the model
    log = applied.replay
    assert log.fallbacks == [] and log.n_sliced > 0
    for label, _, how, rows, _ in log.entries:  # only the last position was recomputed
        assert rows is None or rows[1] == ids.shape[1] - 1, (label, how, rows)
    assert f"{REAL}.recon_clean" not in [e[0] for e in log.entries]  # the clean reconstruction stays


def test_capture_time_when_equals_fork(gpt, sae) -> None:
    model, ids = gpt
    edit = tl.features.clamp([3, 7], 2.5, positions=-1)
    t = tl.trace(model, ids, features={SITE: sae}, intervene=tl.when(f"{SITE}.features", edit))
    want = spliced_logits(model, ids, sae, _clamp_last)
    assert torch.allclose(t.output.logits, want, atol=ATOL)
    assert t[f"{SITE}.features"].out[0, -1, 3] == 2.5


def test_ablate_and_scale_helpers(gpt, sae) -> None:
    model, ids = gpt
    t = tl.trace(model, ids, features={SITE: sae})
    f = t[f"{SITE}.features"].out
    firing = int(torch.argmax(f[0, -1]))

    def zero(g):
        g[..., firing] = 0.0
        return g

    def double(g):
        g[..., -1, firing] *= 2.0
        return g

    fork = t.fork().do(f"{SITE}.features", tl.features.ablate(firing))
    assert torch.allclose(fork.output.logits, spliced_logits(model, ids, sae, zero), atol=ATOL)
    fork = t.fork().do(f"{SITE}.features", tl.features.scale(firing, 2.0, positions=[-1]))
    assert torch.allclose(fork.output.logits, spliced_logits(model, ids, sae, double), atol=ATOL)


def test_forks_sweep_feature_ablations(gpt, sae) -> None:
    model, ids = gpt
    t = tl.trace(model, ids, features={SITE: sae})
    firing = torch.nonzero(t[f"{SITE}.features"].out[0, -1]).flatten().tolist()[:4]
    forks = t.forks([(f"{SITE}.features", tl.features.ablate(i, positions=-1)) for i in firing])
    for i, fork in zip(firing, forks):
        def edit(g, i=i):
            g[..., -1, i] = 0.0
            return g
        assert torch.allclose(fork.output.logits, spliced_logits(model, ids, sae, edit), atol=ATOL)
        log = fork.edits[-1].replay
        assert log.fallbacks == []
        # the decoder's matmul ran once on every fork's row (one read of W_dec), not once per fork
        decode = [e for e in log.entries if e[0] == "matmul_2"] or [e for e in log.entries if e[1] == "matmul"]
        assert decode and decode[0][2] == "rows" and decode[0][4].startswith("stacked"), decode


def test_patch_features_from_another_trace(gpt, sae) -> None:
    model, ids = gpt
    other = torch.flip(ids, dims=[1])
    t = tl.trace(model, ids, features={SITE: sae})
    donor = tl.trace(model, other, features={SITE: sae})
    fork = t.fork().do(f"{SITE}.features", tl.patch_from(donor))
    donor_f = donor[f"{SITE}.features"].out
    want = spliced_logits(model, ids, sae, lambda f: donor_f.clone())
    assert torch.allclose(fork.output.logits, want, atol=ATOL)


def test_steer_adds_decoder_direction(gpt, sae) -> None:
    model, ids = gpt
    t = tl.trace(model, ids, features={SITE: sae})
    fork = t.fork().do(SITE, tl.features.steer(sae, 5, 3.0, positions=-1))
    add = torch.zeros(1, ids.shape[1], 32)
    add[0, -1] = 3.0 * sae.W_dec[5].detach()
    assert torch.allclose(fork.output.logits, spliced_logits(model, ids, sae, add=add), atol=ATOL)


def test_without_error_term(gpt, sae) -> None:
    model, ids = gpt
    t = tl.trace(model, ids, features={SITE: tl.features.attach(sae, use_error_term=False)})
    want = spliced_logits(model, ids, sae, use_error_term=False)
    assert torch.equal(t.output.logits, want)
    assert not torch.allclose(want, plain_logits(model, ids), atol=1e-4)
    fork = t.fork().do(f"{SITE}.features", tl.features.clamp([3, 7], 2.5, positions=-1))
    want = spliced_logits(model, ids, sae, _clamp_last, use_error_term=False)
    assert torch.allclose(fork.output.logits, want, atol=ATOL)


def test_upstream_edit_recomputes_both_reconstructions(gpt, sae) -> None:
    model, ids = gpt
    t = tl.trace(model, ids, features={SITE: sae})
    if sae.cfg.architecture() == "topk":  # which features fire is a data read: replay re-executes, exactly
        with pytest.warns(tl.errors.ReplayFellBack):
            fork = t.fork().do("transformer.h.0", tl.scale(1.5))
        how = fork.edits[-1].how
        assert how.startswith("re-executed")
        # the reason named is the dictionary's TopK selection, never a generated token (d_sae = vocab here)
        assert "TopK feature dictionary at 'blocks.1' selects" in how and "generated token" not in how, how
    else:
        fork = t.fork().do("transformer.h.0", tl.scale(1.5))
        assert fork.edits[-1].how == "replayed"

    def hook(module, args, out):
        return out * 1.5

    handle = model.transformer.h[0].register_forward_hook(hook)
    try:
        want = plain_logits(model, ids)
        x = block_out(model, ids)
    finally:
        handle.remove()
    assert torch.allclose(fork.output.logits, want, atol=ATOL)
    assert torch.allclose(fork[f"{SITE}.features"].out, sae.encode(x).detach(), atol=ATOL)


# -- bad input: named errors, model unchanged ---------------------------------------------------------------


def test_width_mismatch(gpt) -> None:
    model, ids = gpt
    before = hook_state(model)
    with pytest.raises(FeatureWidthError) as err:
        tl.trace(model, ids, features={SITE: saelens_sae(d_in=16, d_sae=32)})
    assert "d_in=16" in str(err.value) and "width 32" in str(err.value) and REAL in str(err.value)
    assert_model_clean(model, before)
    assert torch.equal(tl.trace(model, ids).output.logits, plain_logits(model, ids))


def test_dtype_mismatch(gpt) -> None:
    model, ids = gpt
    before = hook_state(model)
    with pytest.raises(FeatureDtypeError) as err:
        tl.trace(model, ids, features={SITE: saelens_sae(d_in=32).to(torch.float64)})
    assert err.value.which == "dtype" and "float64" in str(err.value)
    assert_model_clean(model, before)


def test_not_a_dictionary(gpt) -> None:
    model, ids = gpt
    before = hook_state(model)
    with pytest.raises(NotAFeatureDictionaryError):
        tl.trace(model, ids, features={SITE: torch.nn.Linear(32, 32)})
    with pytest.raises(InvalidArgumentError):
        tl.trace(model, ids, features=[saelens_sae(d_in=32)])
    assert_model_clean(model, before)


def test_feature_index_out_of_range(gpt) -> None:
    model, ids = gpt
    sae = saelens_sae(d_in=32, d_sae=64)
    t = tl.trace(model, ids, features={SITE: sae})
    out = t.output.logits.clone()
    with pytest.raises(FeatureIndexError) as err:
        t.fork().do(f"{SITE}.features", tl.features.ablate(64))
    assert "d_sae=64" in str(err.value)
    with pytest.raises(FeatureIndexError):
        tl.features.steer(sae, 99, 1.0)
    assert torch.equal(t.output.logits, out)


def test_tuple_site_is_refused(tuple_out) -> None:
    model, args = tuple_out.model, tuple_out.args
    before = hook_state(model)
    with pytest.raises(FeatureSiteError) as err:
        tl.trace(model, *args, features={"pair": saelens_sae(d_in=6, d_sae=12)})
    assert "tuple" in str(err.value)
    assert_model_clean(model, before)


def test_op_site_and_hooks_backend_are_refused(gpt) -> None:
    model, ids = gpt
    sae = saelens_sae(d_in=32)
    with pytest.raises(FeatureSiteError):
        tl.trace(model, ids, features={"blocks.1.resid_mid": sae})
    with pytest.raises(InvalidArgumentError):
        tl.trace(model, ids, features={SITE: sae}, backend="hooks")


def test_sub_site_of_an_unattached_site(gpt) -> None:
    model, ids = gpt
    t = tl.trace(model, ids, features={SITE: saelens_sae(d_in=32)})
    with pytest.raises(tl.SiteNotFoundError):
        t["blocks.0.features"]
    with pytest.raises(EditNotAppliedError):
        tl.trace(model, ids, features={SITE: saelens_sae(d_in=32)},
                 intervene=tl.when("blocks.0.features", tl.features.ablate(0)))


def test_dictionaries_of_a_trace(gpt, sae) -> None:
    model, ids = gpt
    t = tl.trace(model, ids, features={SITE: sae})
    found = tl.features.dictionaries(t)
    assert list(found) == [REAL] and found[REAL].module is sae
    assert tl.features.dictionaries(t.fork().do(f"{SITE}.features", tl.features.ablate(0)))[REAL].module is sae
    assert tl.features.dictionaries(tl.trace(model, ids)) == {}


def test_module_called_twice_has_a_sub_site_per_pass(shared_twice) -> None:
    model, (x,) = shared_twice.model, shared_twice.args
    sae = saelens_sae(d_in=8, d_sae=16, seed=2)
    with torch.no_grad():
        plain = model(x)
    t = tl.trace(model, x, features={"block": sae})
    assert torch.equal(t.output, plain)
    seen = []
    handle = model.block.register_forward_hook(lambda m, a, o: seen.append(o.detach()))
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    assert torch.equal(t["block.features"].out, sae.encode(seen[0]).detach())
    assert torch.equal(t["block.features:2"].out, sae.encode(seen[1]).detach())
    fork = t.fork().do("block.features:2", tl.features.clamp(1, 3.0))

    calls = []

    def hook(m, a, out):
        calls.append(1)
        if len(calls) < 2:
            return None
        f = sae.encode(out)
        g = f.clone()
        g[..., 1] = 3.0
        return out + (sae.decode(g) - sae.decode(f))

    handle = model.block.register_forward_hook(hook)
    try:
        with torch.no_grad():
            want = model(x)
    finally:
        handle.remove()
    assert torch.allclose(fork.output, want, atol=ATOL)


def test_capture_time_edit_of_the_reconstruction(gpt, sae) -> None:
    model, ids = gpt
    t = tl.trace(model, ids, features={SITE: sae}, intervene=tl.when(f"{SITE}.recon", tl.scale(0.5)))
    x = block_out(model, ids)

    def hook(module, args, out):
        recon = sae.decode(sae.encode(out))
        return out + (recon * 0.5 - recon)

    handle = model.transformer.h[1].register_forward_hook(hook)
    try:
        want = plain_logits(model, ids)
    finally:
        handle.remove()
    assert torch.allclose(t.output.logits, want, atol=ATOL)
    assert torch.equal(t[f"{SITE}.recon_clean"].out, sae.decode(sae.encode(x)).detach())  # stays clean


# -- fixes: replay bookkeeping, messages --------------------------------------------------------------------


class _Comparisons(torch.overrides.TorchFunctionMode):
    """Records the shapes of every elementwise ``!=`` made while on."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__ne__, torch.Tensor.ne, torch.ne) and isinstance(args[0], torch.Tensor):
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def test_feature_edit_at_a_position_compares_only_that_row(gpt, sae) -> None:
    """Finding what a positioned feature edit changed reads its rows, not the whole [.., seq, d_sae] tensor."""
    model, ids = gpt
    t = tl.trace(model, ids, features={SITE: sae})
    feats = t[f"{SITE}.features"].out
    firing = torch.nonzero(feats[0, -1]).flatten().tolist()
    assert firing, "the test needs a feature firing at the last position"
    seen = _Comparisons()
    with seen:
        fork = t.fork().do(f"{SITE}.features", tl.features.ablate(firing[:2], positions=-1))
    full = tuple(feats.shape)
    assert full not in seen.shapes, seen.shapes  # no comparison of the whole feature tensor
    assert (1, 1, feats.shape[-1]) in seen.shapes  # the edited row itself was compared
    applied = fork.edits[-1]
    assert applied.n_changed == len(firing[:2])  # the count is still exact
    want = spliced_logits(model, ids, sae, lambda f: _zero_last(f, firing[:2]))
    assert torch.allclose(fork.output.logits, want, atol=ATOL)
    for label, _, how, rows, _ in applied.replay.entries:  # the region found is still the last row
        assert rows is None or rows[1] == ids.shape[1] - 1, (label, how, rows)


def _zero_last(f, features):
    f[..., -1, features] = 0.0
    return f


def test_touched_rows_give_the_full_comparisons_answer() -> None:
    from torchlens.edit._regions import diff_region, edit_touches
    from torchlens.edit.edits import count_changed

    torch.manual_seed(0)
    old = torch.randn(2, 5, 7)
    edit = tl.features.clamp([1, 4], 3.0, positions=[1, -1])
    new = edit(old, ctx=None)
    rows = edit_touches(edit, old)
    assert rows == (1, [1, 4])
    assert diff_region(old, new, rows) == diff_region(old, new)
    assert count_changed(old, new, rows) == count_changed(old, new) == 2 * 2 * 2
    assert edit_touches(tl.features.ablate(3), old) is None  # every position: nothing declared


def test_portable_recipe_refuses_the_attached_dictionary_by_name(gpt, tmp_path) -> None:
    model, ids = gpt
    sae = saelens_sae("standard", d_in=32, d_sae=64, seed=4)
    before = hook_state(model)
    fork = tl.trace(model, ids, features={SITE: sae}).fork().do(f"{SITE}.features",
                                                                 tl.features.ablate(3, positions=-1))
    with pytest.raises(tl.errors.NotPortableError) as info:
        fork.save_intervention(tmp_path / "r", overwrite=True)
    err = info.value
    assert "plain Python function" not in str(err)
    assert "feature dictionary" in err.message and repr(SITE) in err.message and "weights" in err.message
    assert "load_sae" in err.remedy and "features=" in err.remedy and "level='pickle'" in err.remedy
    assert not (tmp_path / "r").exists()
    lin = LinearSAE(32, 40)  # a dictionary that pickles: the pickle level takes it
    fork = tl.trace(model, ids, features={SITE: lin}).fork().do(f"{SITE}.features", tl.features.ablate(3))
    fork.save_intervention(tmp_path / "p", level="pickle")
    assert (tmp_path / "p").exists()
    assert hook_state(model) == before


def test_loaded_trace_names_sub_sites_by_real_address(gpt, tmp_path) -> None:
    """A loaded trace has no model to map ``blocks.1`` to: the canonical spelling is refused, naming the real one."""
    model, ids = gpt
    sae = saelens_sae("standard", d_in=32, d_sae=64, seed=4)
    t = tl.trace(model, ids, features={SITE: sae})
    t.save(tmp_path / "t")
    loaded = tl.load_trace(tmp_path / "t")
    assert torch.equal(loaded[f"{REAL}.features"].out, t[f"{SITE}.features"].out)
    for part in ("features", "error"):
        with pytest.raises(tl.errors.SiteNotFoundError) as info:
            loaded[f"{SITE}.{part}"]
        assert info.value.candidates == [f"{REAL}.{part}"]
        assert "no model" in info.value.message and f"trace['{REAL}.{part}']" in info.value.remedy


def test_positions_outside_the_prompt_are_refused_not_wrapped(gpt, sae) -> None:
    """Feature edits and reads name a position that exists, or raise InvalidArgumentError (not IndexError)."""
    model, ids = gpt
    n = ids.shape[-1]
    trace = tl.trace(model, ids, features={SITE: sae})
    before = hook_state(model)
    for bad in (n, -n - 1, [0, n]):
        with pytest.raises(InvalidArgumentError, match=f"{n} positions"):
            trace.fork().do(f"{SITE}.features", tl.features.ablate(0, positions=bad))
        with pytest.raises(InvalidArgumentError, match=f"{n} positions"):
            tl.trace(model, ids, features={SITE: sae},
                     intervene=tl.when(f"{SITE}.features", tl.features.clamp(0, 1.0, positions=bad)))
    for bad in (n, -n - 1):
        with pytest.raises(InvalidArgumentError, match=f"{n} positions"):
            tl.features.top(trace, SITE, position=bad)
        with pytest.raises(InvalidArgumentError, match=f"{n} positions"):
            tl.features.active(trace, SITE, position=bad)
    with pytest.raises(InvalidArgumentError, match="batch row"):
        tl.features.top(trace, SITE, batch=ids.shape[0])
    assert_model_clean(model, before)
    # in range, negative counts from the end: the same row as its positive spelling
    acts = trace[f"{SITE}.features"].out
    assert torch.equal(tl.features.active(trace, SITE, position=-n).indices, tl.features.active(acts[0, 0]).indices)


def test_steer_position_outside_the_prompt_is_a_named_error(gpt, sae) -> None:
    model, ids = gpt
    trace = tl.trace(model, ids, features={SITE: sae})
    with pytest.raises(InvalidArgumentError):
        trace.fork().do(SITE, tl.features.steer(sae, 0, 2.0, positions=ids.shape[-1]))
