"""mkdocs hook: draw the pictures the pages show, at build time (no image is committed).

Every picture is made by running the code its page shows (the getting-started ``TinyNet``, the
built-in ``TinyLM``) through ``trace.draw`` / ``tl.plots``, and is added to the site as a
generated file under ``images/``. A change to the drawing code therefore reaches the site on the
next build. Needs Graphviz's ``dot`` and matplotlib (``scripts/setup_env.sh`` and the ``viz``
extra install them); without them the build stops with the typed error saying what to install.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from typing import Any

import matplotlib.pyplot as plt
import torch
from mkdocs.structure.files import File
from torch import nn

import torchlens as tl
from torchlens.demo import TinyLM

log = logging.getLogger("mkdocs.hooks.gen_images")


def _tinynet() -> Any:
    """The model of the getting-started page (docs/index.md), verbatim."""

    class TinyNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            h = self.embed(x)
            h = h + self.block(h)  # a residual add that no module owns
            return self.head(h).softmax(dim=-1)

    torch.manual_seed(0)
    return TinyNet().eval(), torch.randn(2, 4)


def _tinylm(n_layers: int = 4) -> tuple[Any, Any, Any]:

    torch.manual_seed(0)
    model = TinyLM(n_layers=n_layers).eval()
    ids = torch.tensor([[5, 12, 7, 33, 9, 21]])
    return model, ids, tl.trace(model, ids)


def _svg(draw: Callable[[], Any]) -> bytes:
    return draw().svg().encode("utf-8")


def _png(figure: Any) -> bytes:

    buf = io.BytesIO()
    figure.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return buf.getvalue()


def pictures() -> dict[str, bytes]:
    """Every picture of the site, by its path under ``docs/`` (``images/...``)."""

    net, x = _tinynet()
    first = tl.trace(net, x)
    model, ids, trace = _tinylm()
    fork = trace.fork("mlp1-zeroed").do(tl.module("blocks.1.mlp"), tl.zero_ablate())
    scaled = trace.fork("attn2-doubled").do(tl.module("blocks.2.attn"), tl.scale(2.0))
    shared = _shared_twice()
    out = {
        "images/first-trace-graph.svg": _svg(lambda: first.draw(depth=None)),
        "images/tinylm-graph.svg": _svg(lambda: trace.draw()),
        "images/tinylm-depth2.svg": _svg(lambda: trace.draw(depth=2)),
        "images/tinylm-focus.svg": _svg(lambda: trace.draw(focus="blocks.1.mlp")),
        "images/shared-unrolled.svg": _svg(lambda: shared.draw(depth=None)),
        "images/shared-rolled.svg": _svg(lambda: shared.draw(depth=None, rolled=True)),
        "images/fork-graph.svg": _svg(lambda: fork.draw(depth=2)),
        "images/compare-graph.svg": _svg(lambda: tl.draw(tl.debug.compare(trace, scaled), depth=2)),
    }
    tokens = [f"t{int(i)}" for i in ids[0]]
    attention = tl.mechinterp.attention_at(trace, 0)
    out["images/attention-patterns.png"] = _png(tl.plots.attention_patterns(attention, tokens=tokens))
    out["images/patching-heatmap.png"] = _png(tl.plots.heatmap(
        _position_ablation(trace, model, ids), cols=tokens, rows=[f"blocks.{i}.mlp" for i in range(4)],
        title="zeroing one block's MLP at one position", label="change of the last position's top logit"))
    with torch.no_grad():
        resid = torch.stack([trace[f"blocks.{i}"].out[0] for i in range(4)])
        lens = model.ln_f(resid) @ model.wte.weight.T
    out["images/logit-lens.png"] = _png(tl.plots.logit_lens(lens, tokens=tokens,
                                                            vocab=[f"t{i}" for i in range(64)]))
    return out


def _shared_twice() -> Any:
    """A residual cell applied twice (weights shared between the two passes), as on the drawing page."""

    class TwoSteps(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(6, 8)
            self.cell = nn.Sequential(nn.Linear(8, 8), nn.GELU())
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            h = self.embed(x)
            for _ in range(2):
                h = h + self.cell(h)
            return self.head(h)

    torch.manual_seed(0)
    return tl.trace(TwoSteps().eval(), torch.randn(3, 6))


def _position_ablation(trace: Any, model: Any, ids: Any) -> Any:
    """(block × position): how much zeroing that block's MLP output at that position moves the top logit."""

    base = trace.output[0, -1]
    top = int(base.argmax())
    grid = torch.zeros(4, ids.shape[1])
    for layer in range(4):
        for pos in range(ids.shape[1]):
            def zero_at(act, *, ctx, pos=pos):
                act = act.clone()
                act[:, pos] = 0
                return act
            fork = trace.fork().do(tl.module(f"blocks.{layer}.mlp"), zero_at)
            grid[layer, pos] = fork.output[0, -1, top] - base[top]
    return grid


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """Add every picture to the site as a generated file."""

    made = pictures()
    for path, content in made.items():
        files.append(File.generated(config, path, content=content))
    log.info("drew %d pictures", len(made))
    return files
