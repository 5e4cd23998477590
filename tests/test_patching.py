"""Patching workflows: every cell equals a plain-hooks re-execution of that cell.

References never go through TorchLens: clean values are read with plain forward (pre-)hooks,
each cell is a plain forward with a hook that writes the clean value, and causal tracing is
checked against a baukit-style implementation (all noised samples in one batch, hooks on the
embedding and on the restored module).
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_model_clean, hook_state

import torchlens as tl
from torchlens.edit._sweep import Sweep
from torchlens.errors import InvalidArgumentError, SiteNotFoundError
from torchlens.patching.activation import _output_read

ATOL = 1e-5  # sliced replay vs a re-executed forward: float32 rounding (see tests/test_slicing.py)


def _corrupt(ids: torch.Tensor, position: int, token: int) -> torch.Tensor:
    out = ids.clone()
    out[0, position] = token
    return out


def _module(model, kind: str, layer: int):
    name = f"blocks.{layer}" if kind == "resid_pre" else f"blocks.{layer}.{kind}"
    return tl.arch(model).module(name)


def _first(value):
    return value[0] if isinstance(value, tuple) else value


def _keep(seen: dict, value: torch.Tensor) -> None:
    seen.setdefault("v", value.clone())  # returns None: the hook leaves the value alone


def _read(model, ids, kind: str, layer: int) -> torch.Tensor:
    """The clean value of a site, read with a plain hook."""
    seen = {}
    module = _module(model, kind, layer)
    if kind == "resid_pre":
        handle = module.register_forward_pre_hook(
            lambda m, a, k: _keep(seen, a[0] if a else k["hidden_states"]), with_kwargs=True)
    else:
        handle = module.register_forward_hook(lambda m, a, o: _keep(seen, _first(o)))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    return seen["v"]


def _patched(model, ids, kind: str, layer: int, position: int, donor: torch.Tensor):
    """The model output with the site's row ``position`` replaced by ``donor``'s (plain hooks)."""
    module = _module(model, kind, layer)

    def write(t):
        t = t.clone()
        t[:, position] = donor[:, position]
        return t

    if kind == "resid_pre":
        def pre(m, args, kwargs):
            if args:
                return (write(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": write(kwargs["hidden_states"])}
        handle = module.register_forward_pre_hook(pre, with_kwargs=True)
    else:
        handle = module.register_forward_hook(
            lambda m, a, o: (write(o[0]), *o[1:]) if isinstance(o, tuple) else write(o))
    try:
        with torch.no_grad():
            return model(ids)
    finally:
        handle.remove()


def _spy_sweeps(monkeypatch) -> list[int]:
    """How many forks each one-pass sweep (``torchlens.edit._sweep.Sweep``) took, appended as it begins."""
    swept = []
    begin = Sweep.begin.__func__

    def spy(cls, engine, read=None):
        got = begin(cls, engine, read)
        swept.append(0 if got is None else len(got.groups_of))
        return got

    monkeypatch.setattr(Sweep, "begin", classmethod(spy))
    return swept


@pytest.mark.parametrize("case_name", ["tiny_gpt2", "tiny_llama"])
@pytest.mark.parametrize("kind", ["resid_pre", "attn", "mlp"])
def test_activation_patching_equals_plain_hooks_every_cell(case_name, kind, request, monkeypatch):
    case = request.getfixturevalue(case_name)
    model, clean_ids = case.model, case.args[0]
    corrupt_ids = _corrupt(clean_ids, 2, 11)
    metric = tl.patching.logit_diff(int(clean_ids[0, 3]), 11)
    swept = _spy_sweeps(monkeypatch)  # the cells of one position (every layer) replay in one pass
    result = tl.patching.activation_patching(clean_ids, corrupt_ids, metric, model=model, site=kind)
    n_layers = tl.arch(model).n_layers
    assert sum(swept) == n_layers * clean_ids.shape[1]  # every cell, in a group per position
    assert result.values.shape == (n_layers, clean_ids.shape[1]) and result.dims == ("layer", "position")
    for layer in range(n_layers):
        donor = _read(model, clean_ids, kind, layer)
        for p in range(clean_ids.shape[1]):
            want = float(metric(_patched(model, corrupt_ids, kind, layer, p, donor)))
            assert abs(float(result.values[layer, p]) - want) < ATOL, (layer, p)
    with torch.no_grad():
        assert abs(result.clean - float(metric(model(clean_ids)))) < ATOL
        assert abs(result.corrupted - float(metric(model(corrupt_ids)))) < ATOL


@pytest.mark.parametrize("case_name", ["tiny_gpt2", "tiny_llama"])
def test_declared_reads_equal_a_metric_reading_the_whole_output(case_name, request):
    """logit_diff declares the two logits it reads (the LM head computes only those); a plain
    function of the output replays the whole head. Both equal the plain-hooks cell."""
    case = request.getfixturevalue(case_name)
    model, clean_ids = case.model, case.args[0]
    corrupt_ids = _corrupt(clean_ids, 1, 11)
    declared = tl.patching.logit_diff(5, 11, position=-2)
    assert declared.reads.columns == (5, 11)

    def plain(output):  # no .reads: every cell computes the whole output
        logits = output.logits[:, -2]
        return (logits[:, 5] - logits[:, 11]).mean()

    clean, corrupted = tl.trace(model, clean_ids), tl.trace(model, corrupt_ids)
    fast = tl.patching.activation_patching(clean, corrupted, declared, site="resid_pre")
    slow = tl.patching.activation_patching(clean, corrupted, plain, site="resid_pre")
    assert torch.allclose(fast.values, slow.values, atol=ATOL)
    donor = _read(model, clean_ids, "resid_pre", 1)
    for p in range(clean_ids.shape[1]):
        want = float(plain(_patched(model, corrupt_ids, "resid_pre", 1, p, donor)))
        assert abs(float(fast.values[1, p]) - want) < ATOL, p
    assert not corrupted.edits and torch.equal(corrupted.output.logits, model(corrupt_ids).logits.detach())


@pytest.mark.parametrize("case_name,proj", [("tiny_gpt2", "c_proj"), ("tiny_llama", "o_proj")])
def test_head_patching_equals_plain_hooks_every_cell(case_name, proj, request, monkeypatch):
    case = request.getfixturevalue(case_name)
    model, clean_ids = case.model, case.args[0]
    corrupt_ids = _corrupt(clean_ids, 1, 7)
    metric = tl.patching.prob(int(clean_ids[0, 2]))
    swept = _spy_sweeps(monkeypatch)
    clean, corrupted = tl.trace(model, clean_ids), tl.trace(model, corrupt_ids)
    # sliced forks (the sweep under test); by default this short causal grid with a whole-row metric is batched
    result = tl.patching.activation_patching(clean, corrupted, metric, site="heads", batched_cells=False)
    view = tl.arch(model)
    assert result.dims == ("layer", "head") and result.values.shape == (view.n_layers, view.n_heads)
    default = tl.patching.activation_patching(clean, corrupted, metric, site="heads")
    assert default.notes["cells"]["batched"] and torch.allclose(default.values, result.values, atol=1e-6)
    # one head at every layer replays in one pass; a later layer's patch joins the whole values
    # the earlier layers' patches made
    assert sum(swept) == view.n_layers * view.n_heads
    for layer in range(view.n_layers):
        out_proj = getattr(view.module(f"blocks.{layer}.attn"), proj)
        seen = {}
        handle = out_proj.register_forward_pre_hook(lambda m, a, seen=seen: _keep(seen, a[0]))
        with torch.no_grad():
            model(clean_ids)
        handle.remove()
        for h in range(view.n_heads):
            cols = slice(h * view.head_dim, (h + 1) * view.head_dim)

            def write(m, a, cols=cols, seen=seen):
                x = a[0].clone()
                x[..., cols] = seen["v"][..., cols]
                return (x,)

            handle = out_proj.register_forward_pre_hook(write)
            try:
                with torch.no_grad():
                    want = float(metric(model(corrupt_ids)))
            finally:
                handle.remove()
            assert abs(float(result.values[layer, h]) - want) < ATOL, (layer, h)


@pytest.mark.parametrize("case_name,proj", [("tiny_gpt2", "c_proj"), ("tiny_llama", "o_proj")])
def test_attribution_patching_of_heads_equals_gradients_read_with_hooks(case_name, proj, request):
    """Each head's estimate is ``(clean - corrupted) · d metric / d head output`` over its slice of
    the output projection's input, the gradient read with plain hooks and autograd."""
    case = request.getfixturevalue(case_name)
    model, clean_ids = case.model, case.args[0]
    corrupt_ids = _corrupt(clean_ids, 1, 7)
    metric = tl.patching.logit_diff(int(clean_ids[0, 2]), 7)
    result = tl.patching.attribution_patching(clean_ids, corrupt_ids, metric, model=model, site="heads")
    view = tl.arch(model)
    assert result.dims == ("layer", "head") and result.values.shape == (view.n_layers, view.n_heads)
    projs = [getattr(view.module(f"blocks.{layer}.attn"), proj) for layer in range(view.n_layers)]

    def inputs(ids, grad: bool) -> tuple[dict, torch.Tensor]:
        seen = {}
        handles = [p.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0]))
                   for i, p in enumerate(projs)]
        try:
            with torch.set_grad_enabled(grad):
                value = metric(model(ids))
        finally:
            for h in handles:
                h.remove()
        return seen, value

    assert all(p.grad is None for p in model.parameters())  # autograd.grad: no parameter's .grad touched
    clean_in, _ = inputs(clean_ids, False)
    corrupt_in, value = inputs(corrupt_ids, True)
    grads = torch.autograd.grad(value, [corrupt_in[i] for i in range(len(projs))])
    assert abs(result.corrupted - float(value.detach())) < ATOL
    for i, g in enumerate(grads):
        per_head = ((clean_in[i] - corrupt_in[i].detach()) * g).unflatten(-1, (view.n_heads, view.head_dim))
        assert torch.allclose(result.values[i] - result.corrupted, per_head.sum((0, 1, 3)), atol=1e-5), i


def _baukit_causal_trace(model, ids, subject, answer, noise, samples, seed, kind, layer, position, clean_value):
    """ROME's trace_with_patch, written with plain hooks: sample s of a batch gets noise row s.
    ``layer`` may be a list of blocks restored together (``clean_value`` then a list, one per block)."""
    view = tl.arch(model)
    layers = [] if layer is None else layer if isinstance(layer, list) else [layer]
    clean_values = clean_value if isinstance(clean_value, list) else [clean_value]
    draws = torch.randn(samples, len(subject), view.d_model, generator=torch.Generator().manual_seed(seed))
    batch = ids.repeat(samples, 1)

    def add_noise(m, a, out):
        out = out.clone()
        out[:, subject] += noise * draws
        return out

    def restore(clean):
        def hook(m, a, out):
            first = _first(out).clone()
            first[:, position] = clean[0, position]
            return (first, *out[1:]) if isinstance(out, tuple) else first
        return hook

    handles = [view.module("embed").register_forward_hook(add_noise)]
    try:
        for block, clean in zip(layers, clean_values):
            site = f"blocks.{block}" if kind == "resid_post" else f"blocks.{block}.{kind}"
            handles.append(view.module(site).register_forward_hook(restore(clean)))
        with torch.no_grad():
            logits = model(batch).logits
    finally:
        for h in handles:
            h.remove()
    return float(logits[:, -1].softmax(-1)[:, answer].mean())


def test_causal_trace_equals_baukit_style_implementation(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    subject = [1, 2]
    results = tl.patching.causal_trace(model, ids, subject, samples=3, seed=4)
    first = next(iter(results.values()))
    answer, noise = first.notes["answer"], first.notes["noise"]
    with torch.no_grad():
        assert answer == int(model(ids).logits[0, -1].argmax())
        assert abs(noise - 3 * float(model.transformer.wte.weight.std())) < 1e-6
    assert abs(first.corrupted - _baukit_causal_trace(model, ids, subject, answer, noise, 3, 4, "mlp", None, 0,
                                                      None)) < ATOL
    for kind, result in results.items():
        for layer in range(2):
            clean_value = _read(model, ids, kind, layer)
            for p in range(ids.shape[1]):
                want = _baukit_causal_trace(model, ids, subject, answer, noise, 3, 4, kind, layer, p, clean_value)
                assert abs(float(result.values[layer, p]) - want) < ATOL, (kind, layer, p)


@pytest.mark.parametrize("case_name,window,layers", [("tiny_gpt2_12", 4, [0, 5, -1]), ("tiny_gpt2_12", 5, [6]),
                                                     ("tiny_llama", 3, None)])
def test_causal_trace_window_restores_rome_s_window_of_blocks_every_cell(case_name, window, layers, request):
    """``window=w``: the cell of layer L restores blocks max(0, L - w//2) .. min(n-1, L - w//2 + w - 1)
    at its position in every noised run (ROME's figures); each cell equals plain hooks restoring
    those blocks' outputs at that position, to 1e-6."""
    case = request.getfixturevalue(case_name)
    model, ids = case.model, case.args[0]
    n = tl.arch(model).n_layers
    subject = [0, 1]
    results = tl.patching.causal_trace(model, ids, subject, samples=2, seed=5, window=window, layers=layers)
    first = next(iter(results.values()))
    answer, noise = first.notes["answer"], first.notes["noise"]
    assert first.notes["window"] == window
    for kind, result in results.items():
        want_rows = list(range(n)) if layers is None else [b % n for b in layers]
        assert result.labels["layer"] == want_rows
        clean = {b: _read(model, ids, kind, b) for b in range(n)}
        for i, layer in enumerate(want_rows):
            span = list(range(max(0, layer - window // 2), min(n - 1, layer - window // 2 + window - 1) + 1))
            assert len(span) > 1 or n == 1
            for p in range(ids.shape[1]):
                want = _baukit_causal_trace(model, ids, subject, answer, noise, 2, 5, kind, span, p,
                                            [clean[b] for b in span])
                assert abs(float(result.values[i, p]) - want) < 1e-6, (kind, layer, p, span)


def test_causal_trace_window_one_is_the_single_block_trace_and_bad_windows_raise(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    plain = tl.patching.causal_trace(model, ids, [1, 2], samples=2, seed=2)
    one = tl.patching.causal_trace(model, ids, [1, 2], samples=2, seed=2, window=1)
    for kind in plain:
        assert torch.equal(plain[kind].values, one[kind].values), kind
    wide = tl.patching.causal_trace(model, ids, [1, 2], samples=2, seed=2, window=2, kinds=["mlp"])["mlp"]
    assert torch.allclose(wide.values[0], plain["mlp"].values[0], atol=1e-6)  # layer 0's window of 2: block 0 alone
    assert not torch.allclose(wide.values[1], plain["mlp"].values[1], atol=1e-6)  # layer 1's: blocks 0 and 1
    before = hook_state(model)
    for bad in (0, -2, 2.0, True, "3", None):
        with pytest.raises(InvalidArgumentError, match="window=") as err:
            tl.patching.causal_trace(model, ids, [1, 2], samples=1, window=bad)
        assert err.value.remedy
        assert_model_clean(model, before)


@pytest.mark.parametrize("kind", ["resid_pre", "resid_post", "attn", "mlp"])
def test_attribution_patching_is_exact_on_a_linear_model(linear_toy, kind):
    model, clean_ids = linear_toy.model, linear_toy.args[0]
    corrupt_ids = _corrupt(clean_ids, 1, 12)
    metric = tl.patching.logit_diff(4, 6)
    before = hook_state(model)
    grads_before = [p.grad for p in model.parameters()]
    estimate = tl.patching.attribution_patching(clean_ids, corrupt_ids, metric, model=model, site=kind)
    assert_model_clean(model, before)
    assert [p.grad for p in model.parameters()] == grads_before  # autograd.grad: no .grad left behind
    exact = tl.patching.activation_patching(clean_ids, corrupt_ids, metric, model=model, site=kind)
    assert torch.allclose(estimate.values, exact.values, atol=1e-4), (estimate.values - exact.values).abs().max()


def test_attribution_patching_approximates_exact_patching(tiny_gpt2):
    model, clean_ids = tiny_gpt2.model, tiny_gpt2.args[0]
    corrupt_ids = _corrupt(clean_ids, 2, 11)
    metric = tl.patching.logit_diff(int(clean_ids[0, 3]), 11)
    estimate = tl.patching.attribution_patching(clean_ids, corrupt_ids, metric, model=model)
    exact = tl.patching.activation_patching(clean_ids, corrupt_ids, metric, model=model)
    assert estimate.values.shape == exact.values.shape
    # positions before the corrupted one are identical in both runs: no estimated change, no change
    assert torch.allclose(estimate.values[:, :2], exact.values[:, :2], atol=ATOL)
    a, b = estimate.values.flatten() - estimate.corrupted, exact.values.flatten() - exact.corrupted
    assert float(torch.corrcoef(torch.stack([a, b]))[0, 1]) > 0.5


@pytest.mark.parametrize("case_name,norm", [("tiny_gpt2", "transformer.ln_f"), ("tiny_llama", "model.norm")])
def test_logit_lens_equals_hand_unembedding(case_name, norm, request):
    case = request.getfixturevalue(case_name)
    model, ids = case.model, case.args[0]
    lens = tl.logit_lens(tl.trace(model, ids))
    assert lens.norm == norm
    view = tl.arch(model)
    final = model.get_submodule(norm)
    with torch.no_grad():
        assert torch.allclose(lens.logits[-1], model(ids).logits, atol=ATOL)  # the last layer is the model's output
        # row 0: the embeddings' output; row L: block L-1's output (TransformerLens's accumulated_resid rows)
        want = view.module("unembed")(final(_read(model, ids, "resid_pre", 0)))
        assert torch.allclose(lens.logits[0], want, atol=ATOL)
        for layer in range(view.n_layers):
            want = view.module("unembed")(final(_read(model, ids, "resid_post", layer)))
            assert torch.allclose(lens.logits[layer + 1], want, atol=ATOL)
    assert lens.layers == list(range(view.n_layers + 1)) and lens.labels[0] == "0_pre"
    ids_top, probs = lens.top(3)
    assert ids_top.shape == (view.n_layers + 1, ids.shape[1], 3) and bool((probs[..., 0] >= probs[..., 1]).all())
    with pytest.raises(InvalidArgumentError):
        lens.top_tokens()


# -- bad inputs: named errors, nothing changed --------------------------------------------------


def test_bad_inputs_raise_named_errors_and_change_nothing(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    clean, corrupted = tl.trace(model, ids), tl.trace(model, _corrupt(ids, 2, 11))
    logits_before = corrupted.output.logits.clone()
    metric = tl.patching.logit_diff(3, 11)
    with pytest.raises(InvalidArgumentError):
        tl.patching.activation_patching(clean, corrupted, metric, site="residual")
    with pytest.raises(InvalidArgumentError):
        tl.patching.activation_patching(clean, tl.trace(model, ids[:, :4]), metric)
    with pytest.raises(InvalidArgumentError):
        tl.patching.activation_patching(clean, corrupted, lambda out: out.logits[0, -1])  # not a scalar
    with pytest.raises(SiteNotFoundError):
        tl.patching.activation_patching(clean, corrupted, metric, layers=[5])
    with pytest.raises(InvalidArgumentError):
        tl.patching.activation_patching(ids, ids, metric)  # inputs without model=
    before = hook_state(model)
    with pytest.raises(InvalidArgumentError):
        tl.patching.attribution_patching(clean, corrupted, lambda out: 1.0)  # not differentiable
    assert_model_clean(model, before)
    with pytest.raises(InvalidArgumentError):
        tl.patching.attribution_patching(clean, corrupted, lambda out: 1.0, site="heads")
    assert_model_clean(model, before)
    with pytest.raises(InvalidArgumentError):
        tl.patching.attribution_patching(clean, corrupted, metric, site="resid_mid")
    with pytest.raises(InvalidArgumentError):
        tl.patching.causal_trace(model, ids[0], [1])
    with pytest.raises(InvalidArgumentError):
        tl.patching.causal_trace(model, ids, [1], kinds=["heads"])
    assert torch.equal(corrupted.output.logits, logits_before) and not corrupted.edits


def test_result_plot_and_normalized(tiny_gpt2):
    pytest.importorskip("matplotlib")
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    result = tl.patching.activation_patching(ids, _corrupt(ids, 2, 11), tl.patching.logit_diff(3, 11), model=model,
                                             site="mlp", positions=[2, 5])
    assert result.labels["position"] == [2, 5]
    norm = result.normalized()
    assert torch.allclose(norm, (result.values - result.corrupted) / (result.clean - result.corrupted))
    fig = result.plot(normalized=True)
    assert len(fig.axes[0].images) == 1


# -- arguments that must not change meaning silently (issue 28) -----------------------------------


def test_positions_outside_the_prompt_raise_and_negative_ones_count_from_the_end(tiny_gpt2):
    """``positions=[6]`` on a 6-token prompt used to patch position 0 (and ``-7`` position 5):
    each is refused naming the prompt length; ``-1`` is the last position, as in Python."""
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    clean, corrupted = tl.trace(model, ids), tl.trace(model, _corrupt(ids, 2, 11))
    logits_before = corrupted.output.logits.clone()
    metric = tl.patching.logit_diff(3, 11)
    before = hook_state(model)
    for bad in ([6], [-7], [1, 10]):
        for site in ("resid_pre", "heads"):
            with pytest.raises(InvalidArgumentError, match="the prompt has 6 positions") as err:
                tl.patching.activation_patching(clean, corrupted, metric, site=site, positions=bad)
            assert err.value.length == 6 and err.value.position == [p for p in bad if not -6 <= p < 6]
            assert err.value.remedy
        with pytest.raises(InvalidArgumentError, match="the prompt has 6 positions"):
            tl.patching.causal_trace(model, ids, subject=bad)
    with pytest.raises(InvalidArgumentError, match="the output has 6 positions"):
        tl.patching.activation_patching(clean, corrupted, tl.patching.logit_diff(3, 11, position=6))
    with pytest.raises(InvalidArgumentError, match="the output has 6 positions"):
        tl.patching.prob(3, position=-7)(corrupted.output)
    assert_model_clean(model, before)
    assert torch.equal(corrupted.output.logits, logits_before) and not corrupted.edits
    last = tl.patching.activation_patching(clean, corrupted, metric, positions=[-1, -4])
    assert last.labels["position"] == [5, 2]
    assert torch.equal(last.values, tl.patching.activation_patching(clean, corrupted, metric, positions=[5, 2]).values)
    by_end = tl.patching.causal_trace(model, ids, subject=[-5, -4], samples=1, kinds=["mlp"])["mlp"]
    assert by_end.notes["subject"] == [1, 2]
    assert torch.equal(by_end.values, tl.patching.causal_trace(model, ids, subject=[1, 2], samples=1,
                                                               kinds=["mlp"])["mlp"].values)
    # a subject position named twice (1 and -5) got one noise row, the other silently dropped: refused
    for twice in ([1, -5], [2, 2]):
        with pytest.raises(InvalidArgumentError, match="twice") as err:
            tl.patching.causal_trace(model, ids, subject=twice, samples=1, kinds=["mlp"])
        assert err.value.remedy
    assert_model_clean(model, before)


@pytest.mark.parametrize("case_name,proj", [("tiny_gpt2", "c_proj"), ("tiny_llama", "o_proj")])
def test_head_patching_per_position_equals_plain_hooks_every_cell(case_name, proj, request):
    """``site="heads", positions=[...]``: a layer × head × position grid, each cell one head's output
    at one position restored — its slice of the output projection's input, that row, written with a
    plain pre-hook."""
    case = request.getfixturevalue(case_name)
    model, clean_ids = case.model, case.args[0]
    corrupt_ids = _corrupt(clean_ids, 1, 7)
    metric = tl.patching.prob(int(clean_ids[0, 2]))
    seq = clean_ids.shape[1]
    positions = [0, 1, -1]
    result = tl.patching.activation_patching(tl.trace(model, clean_ids), tl.trace(model, corrupt_ids), metric,
                                             site="heads", positions=positions)
    view = tl.arch(model)
    assert result.dims == ("layer", "head", "position")
    assert result.values.shape == (view.n_layers, view.n_heads, len(positions))
    assert result.labels == {"layer": list(range(view.n_layers)), "head": list(range(view.n_heads)),
                             "position": [0, 1, seq - 1]}
    # position 0 is before the corrupted token: both runs agree there, restoring it changes nothing
    assert torch.allclose(result.values[..., 0], torch.full_like(result.values[..., 0], result.corrupted), atol=ATOL)
    for layer in range(view.n_layers):
        out_proj = getattr(view.module(f"blocks.{layer}.attn"), proj)
        seen = {}
        handle = out_proj.register_forward_pre_hook(lambda m, a, seen=seen: _keep(seen, a[0]))
        with torch.no_grad():
            model(clean_ids)
        handle.remove()
        for h in range(view.n_heads):
            cols = slice(h * view.head_dim, (h + 1) * view.head_dim)
            for j, p in enumerate(result.labels["position"]):
                def write(m, a, cols=cols, p=p, seen=seen):
                    x = a[0].clone()
                    x[:, p, cols] = seen["v"][:, p, cols]
                    return (x,)

                handle = out_proj.register_forward_pre_hook(write)
                try:
                    with torch.no_grad():
                        want = float(metric(model(corrupt_ids)))
                finally:
                    handle.remove()
                assert abs(float(result.values[layer, h, j]) - want) < ATOL, (layer, h, p)


def _hand_mlp_attribution(model, clean_ids, corrupt_ids, hand_metric, layer: int) -> torch.Tensor:
    """``(clean - corrupted) · d metric / d mlp output`` at each position, summed over rows and
    features, the gradient read with a plain forward hook and autograd."""
    module = tl.arch(model).module(f"blocks.{layer}.mlp")
    clean_out = _read(model, clean_ids, "mlp", layer)
    seen = {}
    handle = module.register_forward_hook(lambda m, a, o: seen.__setitem__("v", o))
    try:
        with torch.enable_grad():
            value = hand_metric(model(corrupt_ids))
    finally:
        handle.remove()
    (grad,) = torch.autograd.grad(value, [seen["v"]])
    return ((clean_out - seen["v"].detach()) * grad).sum((0, 2)) + float(value.detach())


def test_negative_layers_mean_the_last_blocks_in_every_workflow(tiny_gpt2):
    """``layers=[-1]`` is the last block in activation patching (positions and heads), causal
    tracing, attribution patching and the logit lens; out of range (either sign) is refused naming
    the number of blocks, and a canonical name with a negative index says what it would mean."""
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    corrupt_ids = _corrupt(ids, 2, 11)
    clean, corrupted = tl.trace(model, ids), tl.trace(model, corrupt_ids)
    metric = tl.patching.logit_diff(3, 11)
    patch = tl.patching.activation_patching
    for site in ("resid_pre", "mlp", "heads"):
        got = patch(clean, corrupted, metric, site=site, layers=[-1, -2])
        assert got.labels["layer"] == [1, 0]
        assert torch.equal(got.values, patch(clean, corrupted, metric, site=site, layers=[1, 0]).values)
    for site in ("resid_pre", "heads"):
        got = tl.patching.attribution_patching(clean, corrupted, metric, site=site, layers=[-1])
        assert got.labels["layer"] == [1]
        want = tl.patching.attribution_patching(clean, corrupted, metric, site=site, layers=[1])
        assert torch.equal(got.values, want.values)
    traced = tl.patching.causal_trace(model, ids, [1], samples=1, layers=[-1], kinds=["attn"])["attn"]
    assert traced.labels["layer"] == [1]
    assert torch.equal(traced.values, tl.patching.causal_trace(model, ids, [1], samples=1, layers=[1],
                                                               kinds=["attn"])["attn"].values)
    lens = tl.logit_lens(clean, layers=[-1])  # rows are layer boundaries: -1 is the final residual, row 2
    assert lens.layers == [2] and torch.equal(lens.logits, tl.logit_lens(clean, layers=[2]).logits)

    before = hook_state(model)
    logits_before = corrupted.output.logits.clone()
    calls = {
        "activation_patching": lambda bad: patch(clean, corrupted, metric, layers=bad),
        "heads": lambda bad: patch(clean, corrupted, metric, site="heads", layers=bad),
        "attribution_patching": lambda bad: tl.patching.attribution_patching(clean, corrupted, metric, layers=bad),
        "causal_trace": lambda bad: tl.patching.causal_trace(model, ids, [1], layers=bad),
    }
    for name, call in calls.items():
        for bad in ([2], [-3]):
            with pytest.raises(SiteNotFoundError, match="has 2 blocks") as err:
                call(bad)
            assert err.value.length == 2 and err.value.layer == bad, name
    for bad in ([3], [-4]):  # the logit lens has n_layers + 1 rows
        with pytest.raises(SiteNotFoundError, match="has 3 layer boundaries") as err:
            tl.logit_lens(clean, layers=bad)
        assert err.value.length == 3 and err.value.layer == bad
    assert_model_clean(model, before)
    assert torch.equal(corrupted.output.logits, logits_before) and not corrupted.edits
    with pytest.raises(SiteNotFoundError, match="count blocks from 0") as err:
        clean["blocks.-1.mlp"]
    assert "'blocks.1.mlp'" in err.value.remedy and "layers=[-1]" in err.value.remedy


def _answer_batch(tiny_gpt2):
    """A batch of two prompts (the IOI shape: one answer pair per prompt) and their corruptions."""
    ids = tiny_gpt2.args[0]
    clean_ids = torch.cat([ids, ids.flip(1)])
    corrupt_ids = clean_ids.clone()
    corrupt_ids[0, 2], corrupt_ids[1, 2] = 11, 12
    return clean_ids, corrupt_ids


def test_per_row_answers_equal_logits_differenced_by_hand(tiny_gpt2):
    """``logit_diff(correct=[a0, a1], wrong=[b0, b1])``: row ``i`` reads its own pair, on a plain
    output, through the declared reads, in activation patching (fast and plain metric) and in
    attribution patching — each checked against logits read from a plain forward by hand."""
    model = tiny_gpt2.model
    clean_ids, corrupt_ids = _answer_batch(tiny_gpt2)
    correct, wrong = [7, 30], [11, 12]
    metric = tl.patching.logit_diff(correct=torch.tensor(correct), wrong=wrong)
    p_metric = tl.patching.prob(torch.tensor(correct))

    def by_hand(output):
        logits = output.logits[:, -1]
        return ((logits[0, 7] - logits[0, 11]) + (logits[1, 30] - logits[1, 12])) / 2

    def p_by_hand(output):
        probs = output.logits[:, -1].softmax(-1)
        return (probs[0, 7] + probs[1, 30]) / 2

    with torch.no_grad():
        out = model(clean_ids)
    assert abs(float(metric(out)) - float(by_hand(out))) < 1e-6
    assert abs(float(p_metric(out)) - float(p_by_hand(out))) < 1e-6
    for m, hand in ((metric, by_hand), (p_metric, p_by_hand)):  # the declared reads score the same
        read = out.logits[:, -1] if m.reads.columns is None else out.logits[:, -1][:, list(m.reads.columns)]
        assert abs(float(m.reads.score(read)) - float(hand(out))) < 1e-6

    clean, corrupted = tl.trace(model, clean_ids), tl.trace(model, corrupt_ids)
    assert _output_read(corrupted, metric) is not None  # the cells below read two logits per row, not the head
    fast = tl.patching.activation_patching(clean, corrupted, metric, site="resid_pre")
    plain = tl.patching.activation_patching(clean, corrupted, by_hand, site="resid_pre")
    assert fast.values.shape == (2, 6) and torch.allclose(fast.values, plain.values, atol=ATOL)
    with torch.no_grad():
        assert abs(fast.clean - float(by_hand(model(clean_ids)))) < ATOL
        assert abs(fast.corrupted - float(by_hand(model(corrupt_ids)))) < ATOL
    for layer in range(2):
        donor = _read(model, clean_ids, "resid_pre", layer)
        for p in range(6):
            want = float(by_hand(_patched(model, corrupt_ids, "resid_pre", layer, p, donor)))
            assert abs(float(fast.values[layer, p]) - want) < ATOL, (layer, p)
    probs = tl.patching.activation_patching(clean, corrupted, p_metric, site="mlp", positions=[2, -1])
    donor = _read(model, clean_ids, "mlp", 1)
    assert abs(float(probs.values[1, 1]) - float(p_by_hand(_patched(model, corrupt_ids, "mlp", 1, 5, donor)))) < ATOL

    estimate = tl.patching.attribution_patching(clean, corrupted, metric, site="mlp")
    for layer in range(2):
        want = _hand_mlp_attribution(model, clean_ids, corrupt_ids, by_hand, layer)
        assert torch.allclose(estimate.values[layer], want, atol=ATOL), layer


def test_ambiguous_or_mismatched_answers_raise_named_errors(tiny_gpt2):
    model = tiny_gpt2.model
    clean_ids, corrupt_ids = _answer_batch(tiny_gpt2)
    clean, corrupted = tl.trace(model, clean_ids), tl.trace(model, corrupt_ids)
    logits_before = corrupted.output.logits.clone()
    for correct, wrong in ((torch.tensor([[7, 30]]), 11), ([[7], [30]], [11, 12]), (torch.tensor([7.0, 30.0]), 11),
                           ([7, 30], [11, 12, 13]), ([], 11), (True, 11), ([7, -1], 11)):
        with pytest.raises(InvalidArgumentError):
            tl.patching.logit_diff(correct, wrong)
    with pytest.raises(InvalidArgumentError):
        tl.patching.prob(torch.tensor([[7, 30]]))
    before = hook_state(model)
    three = tl.patching.logit_diff([7, 30, 2], [11, 12, 13])  # three answers, two rows
    for metric in (three, tl.patching.prob([7, 30, 2]), tl.patching.logit_diff([7, 64], 11)):  # 64: past the vocab
        with pytest.raises(InvalidArgumentError):
            metric(clean.output)
        for call in (tl.patching.activation_patching, tl.patching.attribution_patching):
            with pytest.raises(InvalidArgumentError) as err:
                call(clean, corrupted, metric)
            assert err.value.remedy
    with pytest.raises(InvalidArgumentError, match="lists 3 answer"):
        tl.patching.activation_patching(clean, corrupted, three, site="heads")
    assert_model_clean(model, before)
    assert torch.equal(corrupted.output.logits, logits_before) and not corrupted.edits


def test_a_metric_reading_a_pad_position_is_refused(tiny_gpt2):
    """Right-padded prompts of different lengths: logit_diff at -1 scored row 1's pad token, silently (as
    TransformerLens's would). Refused, naming the rows; a position every prompt has, and left padding, work."""
    model = tiny_gpt2.model
    ids = torch.tensor([[5, 17, 3, 42, 9, 11], [1, 2, 3, 4, 0, 0]])
    right = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    clean = tl.trace(model, input_ids=ids, attention_mask=right)
    corrupted = tl.trace(model, input_ids=_corrupt(ids, 1, 60), attention_mask=right)
    sae = tl.features.SavedSAE({"d_in": 32, "d_sae": 16}, {
        "W_enc": torch.ones(32, 16) / 32, "b_enc": torch.zeros(16), "W_dec": torch.ones(16, 32) / 16,
        "b_dec": torch.zeros(32)})
    before = hook_state(model)
    for call in (lambda m: tl.patching.activation_patching(clean, corrupted, m, site="resid_pre"),
                 lambda m: tl.patching.attribution_patching(clean, corrupted, m, site="resid_pre"),
                 lambda m: tl.patching.feature_patching(clean, corrupted, m, site="blocks.0", sae=sae, features=[0])):
        with pytest.raises(InvalidArgumentError, match=r"padding in row\(s\) \[1\]") as err:
            call(tl.patching.logit_diff(3, 4))
        assert "padding_side" in err.value.remedy
        with pytest.raises(InvalidArgumentError, match="padding"):
            call(tl.patching.prob(3, position=5))
        call(tl.patching.logit_diff(3, 4, position=3))  # a real token of both rows
    assert_model_clean(model, before)
    left_ids, left = torch.tensor([[5, 17, 3, 42, 9, 11], [0, 0, 1, 2, 3, 4]]), right.flip(-1)
    grid = tl.patching.activation_patching(tl.trace(model, input_ids=left_ids, attention_mask=left),
                                           tl.trace(model, input_ids=_corrupt(left_ids, 3, 60), attention_mask=left),
                                           tl.patching.logit_diff(3, 4), site="resid_pre")
    assert grid.values.shape == (2, 6)
