"""The nnsight 0.8 usage guide and the migration seed fence, run through the shim.

Every example of /work/shared/seeds/nnsight-0.8-usage-guide.txt that needs neither
real GPT-2 weights nor NDIF is copied here as written, except the model
construction: ``TransformersModel(<random GPT2LMHeadModel(GPT2Config())>,
tokenizer=<local WordPiece tokenizer>)`` instead of a Hub download, and without the
asserts about " Paris" / " London" (random weights predict neither). Each example
runs with real nnsight and with the shim on copies of one model, and their values
must agree. The remote example must raise the shim's typed refusal.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pathlib
import subprocess
import sys
import warnings

import nnsight as real_nnsight
import pytest
import torch
import torchlens_shims.nnsight as shim
import transformers
from torchlens_shims.nnsight import errors

warnings.filterwarnings("ignore", message=".*Model config.*")

SEED_FENCE = pathlib.Path("/work/shared/acceptance/seed_fences/nnsight_guide_nnsight.py")
ROOT = pathlib.Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv" / "bin" / "python"


def guide_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """WordPiece over a few words, splitting "Eiffel" so the guide's prompt is 10 tokens, as with GPT-2."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "<unk> <|endoftext|> The E ##iff ##el Tower is in the city of Paris London".split()
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )


@functools.cache
def _gpt2_default() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape
        assert torch.allclose(a.detach().float(), b.detach().float(), atol=1e-5)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    else:
        assert a == b


@pytest.fixture(scope="module")
def models():
    """One wrapped copy of the 12-layer model per library (nnsight instruments what it wraps)."""
    tok = guide_tokenizer()
    return {
        name: (lib, lib.TransformersModel(copy.deepcopy(_gpt2_default()), tokenizer=copy.deepcopy(tok)))
        for name, lib in (("nnsight", real_nnsight), ("shim", shim))
    }


def run_both(models, example):
    results = {name: example(lib, model) for name, (lib, model) in models.items()}
    assert_same(results["nnsight"], results["shim"])
    module = models["shim"][1]._module
    for name, sub in module.named_modules():
        assert not sub._forward_hooks and not sub._forward_pre_hooks and "forward" not in sub.__dict__, name
    return results["shim"]


# -- Orientation ---------------------------------------------------------------------------------------
def example_orientation(nnsight, model):
    prompt = "The Eiffel Tower is in the city of"

    with model.trace(prompt):
        clean = model.output.logits.save()                     # read the output

    with model.trace(prompt):
        resid = model.transformer.h[5].output.save()           # read an activation
        model.transformer.h[8].output[:, -1, :] *= 2           # modify one
        edited = model.output.logits.save()                    # see what it changed

    assert tuple(resid.shape) == (1, 10, 768)
    return clean, resid, edited


def test_orientation(models):
    clean, _, edited = run_both(models, example_orientation)
    assert not torch.allclose(clean, edited)


# -- 1. .save() or it never existed ------------------------------------------------------------------------
def example_save_containers(nnsight, model):
    with model.trace("The Eiffel Tower is in the city of"):
        per_layer = nnsight.save([])                  # save the list…
        for block in model.transformer.h:
            per_layer.append(block.output[0, -1])     # …append raw values

    assert len(per_layer) == 12
    return per_layer


def test_save_containers(models):
    per_layer = run_both(models, example_save_containers)
    assert isinstance(per_layer, list) and per_layer[0].shape == (768,)


# -- 3. model.scan -------------------------------------------------------------------------------------------
def example_scan(nnsight, meta):
    prompt = "The Eiffel Tower is in the city of"
    with meta.scan(prompt):
        hidden_size = nnsight.save(meta.transformer.h[0].output.shape[-1])
        n_layers = nnsight.save(len(meta.transformer.h))
        resid_shape = nnsight.save(tuple(meta.transformer.h[-1].output.shape))

    print(hidden_size, n_layers, resid_shape)             # 768 12 (1, 10, 768)
    return hidden_size, n_layers, resid_shape


def test_scan(models, capsys):
    assert run_both(models, example_scan) == (768, 12, (1, 10, 768))
    assert "768 12 (1, 10, 768)" in capsys.readouterr().out


# -- Core moves: batch a sweep ----------------------------------------------------------------------------
def example_sweep(nnsight, model):
    prompt = "The Eiffel Tower is in the city of"
    paris = model.tokenizer(" Paris").input_ids[0]

    with model.trace() as tracer:
        scores = nnsight.save([])
        for layer in range(len(model.transformer.h)):
            with tracer.invoke(prompt):
                model.transformer.h[layer].output[:, -1, :] = 0
                scores.append(model.output.logits[0, -1, paris])

    print([round(s.item(), 2) for s in scores])     # 12 ablations, one forward pass
    return scores


def test_sweep(models):
    assert len(run_both(models, example_sweep)) == 12


# -- Core moves: tracer.cache ---------------------------------------------------------------------------------
def example_cache(nnsight, model):
    prompt = "The Eiffel Tower is in the city of"
    with model.trace(prompt) as tracer:
        cache = tracer.cache(modules=[model.transformer.h[0], model.transformer.h[11]])

    print(cache["model.transformer.h.0"].output.shape)
    return cache["model.transformer.h.0"].output, cache["model.transformer.h.11"].output


def test_cache(models):
    h0, _ = run_both(models, example_cache)
    assert h0.shape == (1, 10, 768) and not h0.requires_grad


# -- Core moves: gradients ----------------------------------------------------------------------------------------
def example_gradients(nnsight, model):
    prompt = "The Eiffel Tower is in the city of"
    paris = model.tokenizer(" Paris").input_ids[0]
    with model.trace(prompt):
        hidden = model.transformer.h[-1].output
        metric = model.output.logits[0, -1, paris]
        with metric.backward():
            grad = hidden.grad.clone().save()

    print(grad.shape)
    return grad


def test_gradients(models):
    assert run_both(models, example_gradients).shape == (1, 10, 768)


# -- Core moves: generation ------------------------------------------------------------------------------------------
def example_generation(nnsight, model):
    prompt = "The Eiffel Tower is in the city of"
    with model.generate(prompt, max_new_tokens=3, min_new_tokens=3) as tracer:
        picks = nnsight.save([])
        for step in tracer.iter[:3]:  # noqa: B007 - as nnsight code writes it
            picks.append(model.output.logits[0, -1].argmax(dim=-1))
        ids = tracer.result.save()

    assert len(picks) == 3
    print(model.tokenizer.decode(ids[0]))
    return picks, ids


def test_generation(models):
    picks, ids = run_both(models, example_generation)
    assert ids.shape == (1, 13) and [int(p) for p in picks] == ids[0, 10:].tolist()


# -- Running on NDIF: refused with a typed error ----------------------------------------------------------------------
def test_remote_example_is_refused(models):
    model = models["shim"][1]
    prompt = "The Eiffel Tower is in the city of"
    with pytest.raises(errors.RemoteUnsupportedError) as info:
        with model.trace(prompt, remote=True):
            last = model.transformer.h[-1].output[:, -1].detach().cpu().save()  # noqa: F841
    assert isinstance(info.value, errors.ShimUnsupportedError)
    assert "TorchLens runs the local eager forward" in info.value.remedy
    with pytest.raises(errors.RemoteUnsupportedError):
        with model.session(remote=True):
            pass


# -- The migration seed fence, then both libraries in one process ------------------------------------------
ORDER_CHECK = """
import torch, transformers
import nnsight
from torchlens_shims.nnsight.errors import SaveOutsideTraceError
shim = sys.modules["torchlens_shims.nnsight"]
cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
ids = torch.tensor([[1, 2, 3]])
grads = []
for lib in (nnsight, shim, nnsight, shim):
    torch.manual_seed(0)
    model = lib.NNsight(transformers.GPT2LMHeadModel(cfg).eval())
    with model.trace(ids):
        h = model.transformer.h[0].output
        metric = model.output.logits[0, -1, 3]
        with metric.backward():
            g = h.grad.save()
    grads.append(g)
assert all(torch.allclose(grads[0], x) for x in grads)
x = torch.ones(2, requires_grad=True)
(x * 2).sum().backward()
assert x.grad.tolist() == [2.0, 2.0]
try:
    torch.zeros(1).save()
except (SaveOutsideTraceError, ValueError):
    print("ORDER=ok")
"""


def test_seed_fence_passes_with_the_import_rewritten(tmp_path):
    """The fence runs on the shim alone; then, in the same process, real nnsight is loaded
    *after* the shim (both mount ``.save`` and wrap ``Tensor.backward``) and both still work."""
    if not SEED_FENCE.exists():
        pytest.skip("seed fence not present")
    text = SEED_FENCE.read_text()
    assert "from nnsight import" in text
    script = tmp_path / "fence.py"
    script.write_text(text.replace("from nnsight import", "from torchlens_shims.nnsight import"))
    (tmp_path / "order.py").write_text("import sys\n" + ORDER_CHECK)
    runner = (
        "import json, runpy, sys, warnings\n"
        "warnings.filterwarnings('ignore')\n"
        "namespace = runpy.run_path(sys.argv[1])\n"
        "print('RESULT=' + json.dumps(namespace['RESULT']))\n"
        "assert 'nnsight' not in sys.modules, 'real nnsight was imported'\n"
        "runpy.run_path(sys.argv[2])\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    python = str(PYTHON) if PYTHON.exists() else sys.executable
    done = subprocess.run(
        [python, "-c", runner, str(script), str(tmp_path / "order.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT=")][-1]
    assert json.loads(line[len("RESULT="):]) == [[1, 4, 32], True]
    assert "ORDER=ok" in done.stdout
