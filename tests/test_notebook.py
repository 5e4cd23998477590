"""Notebook HTML, summary(), to_pandas(), plots and progress bars, against hand-computed values.

References: forward hooks on the model (output shapes), ``named_modules`` (parameter counts),
nbytes computed by hand, and values the figures must show computed directly with torch.
"""

from __future__ import annotations

import io
import os
import sys
from html.parser import HTMLParser

import pytest
import torch

import torchlens as tl
from torchlens import _progress
from torchlens.analysis.notebook import trace_html
from torchlens.analysis.summary import memory_held, package_path
from torchlens.core.repr_html import repr_html
from torchlens.errors import InvalidArgumentError, OptionalDependencyError, TorchLensError


class Rows(HTMLParser):
    """Counts table rows per <details> section and collects text."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows += 1

    def handle_data(self, data):
        self.text.append(data)


def parse_html(html: str) -> Rows:
    p = Rows()
    p.feed(html)
    return p


def hooked_shapes(model, *args) -> dict[str, tuple]:
    shapes = {}
    def keep(mod, inputs, out, name):
        if isinstance(out, torch.Tensor):
            shapes[name] = tuple(out.shape)

    handles = [m.register_forward_hook(lambda mod, i, o, name=name: keep(mod, i, o, name))
               for name, m in model.named_modules() if name]
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for h in handles:
            h.remove()
    return shapes


def test_trace_html_has_the_summary_and_every_op(small_mlp, mlp_input):
    trace = tl.trace(small_mlp, mlp_input)
    html = trace._repr_html_()
    text = "".join(parse_html(html).text)
    assert "SmallMLP" in text and "4" in text
    # memory held, by hand: input 3x4, fc1 3x6, relu 3x6, fc2 3x3 float32 values
    assert memory_held(trace) == 4 * (12 + 18 + 18 + 9)
    assert "228 B" in text
    for op in trace.ops:
        assert op.label in text
    op_rows = html.count("<tr><td>")  # data rows of the op tables (facts rows start with <th>)
    assert op_rows == len(trace.ops)


def test_fork_html_lists_its_edit(small_mlp, mlp_input):
    trace = tl.trace(small_mlp, mlp_input)
    fork = trace.fork("z").do("fc1", tl.zero_ablate())
    text = "".join(parse_html(fork._repr_html_()).text)
    assert "1 edit(s)" in text and "fc1" in text and "18 elements changed" in text  # 3x6 zeroed
    assert 'class="tl-edit"' in fork._repr_html_()


def test_op_modulecall_report_comparison_recipe_html(small_mlp, mlp_input, tmp_path):
    trace = tl.trace(small_mlp, mlp_input)
    op = trace["relu_1"].record
    text = "".join(parse_html(op._repr_html_()).text)
    assert "relu" in text and "(3,6)" in text and "linear_1" in text and "linear_2" in text  # parents/children
    call = trace["fc2"].record
    assert "Linear" in call._repr_html_() and "linear_2" in call._repr_html_()
    report = tl.validate(trace)
    assert "OK" in report._repr_html_() and f"{report.n_checked:,} of {len(trace.ops)}" in report._repr_html_()
    fork = trace.fork("z").do("act", tl.zero_ablate())
    cmp_html = tl.debug.compare(trace, fork)._repr_html_()
    assert "first divergence" in cmp_html and ">act<" in cmp_html  # the zeroed module
    fork.save_intervention(tmp_path / "r.tlspec")
    recipe = tl.load_intervention(tmp_path / "r.tlspec")
    assert "zero_ablate" in recipe._repr_html_() and "SmallMLP" in recipe._repr_html_()


def test_html_caps_rows_for_huge_traces(monkeypatch, small_mlp, mlp_input):
    from torchlens.analysis import notebook

    monkeypatch.setattr(notebook, "MAX_ROWS", 2)
    html = tl.trace(small_mlp, mlp_input)._repr_html_()
    assert html.count("<tr><td>") == 2 and "more op(s)" in html


def test_summary_matches_hooks_and_parameter_counts(tiny_gpt2):
    model, args = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, *args)
    s = trace.summary()
    shapes = hooked_shapes(model, *args)
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in model.named_modules()}
    rows = {r.address: r for r in s.rows}
    for name in ("transformer.h.0.mlp.c_fc", "transformer.h.1.mlp", "transformer.ln_f", "lm_head"):
        assert rows[name].out_shape == shapes[name]
        assert rows[name].n_params == params[name]
    assert rows[""].n_params == params[""]
    text = str(s)
    assert "transformer.h.0.mlp" in text and f"{params['transformer.h.0.mlp']:,}" in text
    assert "<table>" in s._repr_html_()


def test_to_pandas_one_row_per_op(small_mlp, mlp_input):
    pd = pytest.importorskip("pandas", reason="pandas is the optional [pandas] extra")
    trace = tl.trace(small_mlp, mlp_input)
    df = trace.to_pandas()
    assert isinstance(df, pd.DataFrame)
    assert list(df.columns) == ["label", "func", "module", "pass", "shape", "dtype", "source", "source_path",
                                "parents"]
    assert list(df["label"]) == ["input_0", "linear_1", "relu_1", "linear_2"]
    shapes = hooked_shapes(small_mlp, mlp_input)
    assert df.set_index("label").loc["linear_2", "shape"] == shapes["fc2"]
    assert df.set_index("label").loc["linear_2", "parents"] == ["relu_1"]
    assert df.set_index("label").loc["relu_1", "module"] == "act"
    assert set(df["dtype"]) == {"float32"}


def test_to_pandas_pass_is_an_integer_and_source_reads_from_the_package(tiny_gpt2):
    pd = pytest.importorskip("pandas", reason="pandas is the optional [pandas] extra")
    import transformers
    from transformers.models.gpt2 import modeling_gpt2

    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    df = trace.to_pandas()
    assert df["pass"].dtype == pd.Int64Dtype()  # the input row has no pass: nullable integers
    inputs = [op.index for op in trace.ops if op.is_input]
    assert df["pass"].isna().tolist() == [op.index in inputs for op in trace.ops]
    assert df["pass"].dropna().tolist() == [op.module_pass for op in trace.ops if not op.is_input]
    site_packages = os.path.dirname(os.path.dirname(transformers.__file__))
    attn = [op for op in trace.ops if op.module == "transformer.h.0.attn"]
    paths = [op.source.rpartition(":")[0] for op in attn]
    want = [os.path.relpath(p, site_packages).replace(os.sep, "/") + ":" + op.source.rpartition(":")[2]
            for p, op in zip(paths, attn)]
    block_ops = df[df["module"] == "transformer.h.0.attn"]
    assert block_ops["source_path"].tolist() == paths and block_ops["source"].tolist() == want
    assert modeling_gpt2.__file__ in paths and all(w.startswith("transformers/") for w in want)
    assert not any(s.startswith("/") for s in df["source"])


def test_package_path_starts_at_the_top_package(tmp_path):
    for folder in ("pkg", "pkg/sub"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    module, script = tmp_path / "pkg" / "sub" / "mod.py", tmp_path / "tools" / "run.py"
    assert package_path(str(module), roots=[]) == "pkg/sub/mod.py"  # outside every import folder
    assert package_path(str(module), roots=[str(tmp_path / "pkg" / "sub")]) == "pkg/sub/mod.py"  # a folder in it
    assert package_path(str(script), roots=[str(tmp_path)]) == "tools/run.py"
    assert package_path("<string>", roots=[]) == "<string>"


def test_to_pandas_without_pandas_raises_the_typed_error(monkeypatch, small_mlp, mlp_input):
    monkeypatch.setitem(sys.modules, "pandas", None)
    trace = tl.trace(small_mlp, mlp_input)
    with pytest.raises(OptionalDependencyError) as info:
        trace.to_pandas()
    assert "torchlens[pandas]" in info.value.remedy


@pytest.fixture(scope="module")
def plt():
    return pytest.importorskip("matplotlib.pyplot", reason="matplotlib is the optional [viz] extra")


def test_attention_patterns_show_the_facet_pattern(tiny_gpt2, plt):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    attention = tl.mechinterp.attention_at(trace, 1)
    tokens = [f"tok{i}" for i in range(6)]
    fig = tl.plots.attention_patterns(attention, tokens=tokens)
    panels = [ax for ax in fig.axes if ax.images and ax.get_title().startswith("head")]
    assert len(panels) == 2  # tiny GPT-2 has two heads
    # the pattern computed by hand from the recorded q, k: causal softmax(q k^T / sqrt(d))
    q, k = attention.q.clone(), attention.k.clone()
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(6, 6).triu(1).bool(), float("-inf"))
    expected = scores.softmax(-1)[0]
    for h, ax in enumerate(panels):
        assert torch.allclose(torch.as_tensor(ax.images[0].get_array()), expected[h], atol=1e-5)
        assert [t.get_text() for t in ax.get_xticklabels()] == tokens
    plt.close(fig)
    with pytest.raises(InvalidArgumentError):
        tl.plots.attention_patterns(attention, tokens=tokens[:3])
    with pytest.raises(InvalidArgumentError):
        tl.plots.attention_patterns(attention, heads=[5])


def test_heatmap_is_centred_at_zero_and_logit_lens_shows_top_tokens(plt):
    values = torch.tensor([[0.5, -2.0, 1.0], [0.0, 0.25, -0.75]])
    fig = tl.plots.heatmap(values, cols=["a", "b", "c"], label="effect")
    image = fig.axes[0].images[0]
    assert image.norm.vmin == -2.0 and image.norm.vmax == 2.0  # symmetric about zero, by hand
    assert torch.equal(torch.as_tensor(image.get_array()), values)
    plt.close(fig)
    with pytest.raises(InvalidArgumentError):
        tl.plots.heatmap(torch.zeros(2, 3, 4))
    logits = torch.tensor([[[0.0, 5.0, 0.0], [3.0, 0.0, 0.0]], [[0.0, 0.0, 4.0], [0.0, 2.0, 0.0]]])
    fig = tl.plots.logit_lens(logits, vocab=["x", "y", "z"], tokens=["p0", "p1"])
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["y", "x", "z", "y"]  # argmax per (layer, position), by hand
    probs = torch.as_tensor(fig.axes[0].images[0].get_array())
    assert torch.allclose(probs, logits.softmax(-1).max(-1).values)
    plt.close(fig)


def test_progress_is_off_without_a_terminal_and_on_when_asked(monkeypatch, small_mlp, mlp_input):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not _progress.progress_enabled(None)  # not a terminal
    assert not _progress.progress_enabled(False)
    assert list(_progress.track([1, 2, 3], desc="x", progress=True)) == [1, 2, 3]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert _progress.progress_enabled(None)
    monkeypatch.setenv("TORCHLENS_PROGRESS", "0")
    assert not _progress.progress_enabled(None)
    report = tl.validate(tl.trace(small_mlp, mlp_input), progress=False)
    assert report.ok
    monkeypatch.setattr(_progress, "_tqdm", None)
    with pytest.raises(OptionalDependencyError):
        _progress.track([1], desc="x", progress=True)
    assert list(_progress.track([1, 2], desc="x")) == [1, 2]  # automatic mode just goes quiet


def test_repr_html_dispatches_by_type_and_refuses_an_unregistered_one():
    """The objects' ``_repr_html_`` asks one lookup that ``analysis.notebook`` fills: a Fork (a Trace
    subclass) gets the trace renderer; a type nobody registered is a TorchLensError with a remedy."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    fork = tl.trace(model, torch.randn(2, 3)).fork()
    assert fork._repr_html_() == repr_html(fork) == trace_html(fork)

    class Unshown:
        pass

    with pytest.raises(TorchLensError) as err:
        repr_html(Unshown())
    assert "Unshown" in str(err.value) and "import torchlens" in err.value.remedy
