"""PatchingResult.plot: the plotted grid (the normalised share of the clean–corrupted gap by
default), the colour scale and the token labels of the position axis, read back from the figure."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torchlens as tl
from torchlens.errors import InvalidArgumentError

pytest.importorskip("matplotlib")


class WordTokenizer:
    """Decodes id i as "<i>" (what a Hugging Face tokenizer's decode([i]) is used for)."""

    def decode(self, ids):
        return "".join(f"<{int(i)}>" for i in ids)


@pytest.fixture
def grid(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    corrupt = ids.clone()
    corrupt[0, 2] = 11
    metric = tl.patching.logit_diff(3, 11)
    with torch.no_grad():  # the baselines read from plain forwards, not from the result
        clean, corrupted = float(metric(model(ids))), float(metric(model(corrupt)))
    result = tl.patching.activation_patching(ids, corrupt, metric, model=model, site="mlp", positions=[2, 5])
    yield result, clean, corrupted, ids
    import matplotlib.pyplot as plt  # optional dependency, skipped above when missing

    plt.close("all")


def _image(fig):
    ax = fig.axes[0]
    (image,) = ax.images
    return ax, image


def test_plot_draws_the_normalised_gap_with_token_strings(grid):
    result, clean, corrupted, ids = grid
    want = [[(v - corrupted) / (clean - corrupted) for v in row] for row in result.values.tolist()]
    words = ["The", " cat", " sat", " on", " the", " mat"]
    ax, image = _image(result.plot(tokens=words))
    assert np.allclose(np.asarray(image.get_array()), want, atol=1e-4)
    low, high = image.get_clim()
    bound = max(1.0, float(np.abs(want).max()))
    assert (low, high) == pytest.approx((-bound, bound))  # white: no change; full red: the clean metric
    assert [t.get_text() for t in ax.get_xticklabels()] == [" sat", " mat"]  # positions 2 and 5
    ax, _ = _image(result.plot(tokenizer=WordTokenizer()))
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"<{int(ids[0, 2])}>", f"<{int(ids[0, 5])}>"]


def test_plot_raw_values_are_centred_at_the_corrupted_metric(grid):
    result, clean, corrupted, _ = grid
    ax, image = _image(result.plot(normalized=False))
    assert np.allclose(np.asarray(image.get_array()), result.values.numpy())
    low, high = image.get_clim()
    assert (low + high) / 2 == pytest.approx(corrupted, abs=1e-5)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2", "5"]
    unknown = tl.patching.PatchingResult(result.values, result.dims, result.labels, result.metric)
    _, image = _image(unknown.plot())  # no baselines: raw values around zero
    assert np.allclose(np.asarray(image.get_array()), result.values.numpy())
    assert sum(image.get_clim()) == pytest.approx(0.0)


def test_plot_refuses_labels_that_do_not_fit(grid, tiny_gpt2):
    result, *_ = grid
    with pytest.raises(InvalidArgumentError):
        result.plot(tokens=["a", "b", "c"])  # position 5 has no token
    with pytest.raises(InvalidArgumentError):
        tl.patching.PatchingResult(result.values, result.dims, result.labels, "m").plot(tokenizer=WordTokenizer())
    with pytest.raises(InvalidArgumentError):
        result.plot(tokenizer=object())
    with pytest.raises(InvalidArgumentError):
        tl.patching.PatchingResult(result.values, result.dims, result.labels, "m", 1.0, 1.0).plot(normalized=True)
    heads = tl.patching.PatchingResult(torch.zeros(2, 2), ("layer", "head"), {"layer": [0, 1], "head": [0, 1]}, "m")
    with pytest.raises(InvalidArgumentError):
        heads.plot(tokens=["a", "b"])
