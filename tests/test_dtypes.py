"""Half-precision models (bf16, fp16): trace, validate, replay and the shims reproduce the plain
model exactly on CPU (same kernels on the same inputs); facets score attention in float32 and
return the model's dtype (docs/big-models.md, "Half precision")."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import edited_forward, hook_reads

import torchlens as tl

DTYPES = [torch.bfloat16, torch.float16]
# What a facet recomputed in float32 may differ by from the fused kernel's own low-precision result.
FACET_ATOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module", params=DTYPES, ids=["bf16", "fp16"])
def half(request, tiny_gpt2):
    return copy.deepcopy(tiny_gpt2.model).to(request.param), tiny_gpt2.args[0], request.param


def test_trace_values_and_validate_are_exact(half):
    model, ids, dtype = half
    trace = tl.trace(model, ids)
    hooked, out = hook_reads(model, (ids,))
    assert trace["transformer.h.1"].out[0].dtype == dtype
    torch.testing.assert_close(trace["transformer.h.1"].out[0], hooked["transformer.h.1"][0][0], rtol=0, atol=0)
    torch.testing.assert_close(trace.output.logits, out.logits, rtol=0, atol=0)
    report = tl.validate(trace, atol=0.0)
    assert report.ok, report.summary()
    assert report.output_max_abs_error == 0.0


def test_replay_equals_a_hooked_forward(half):
    model, ids, _ = half
    fork = tl.trace(model, ids).fork().do("transformer.h.0.mlp", tl.scale(0.5))
    want = edited_forward(model, "transformer.h.0.mlp", lambda o: o * 0.5, (ids,))
    torch.testing.assert_close(fork.output.logits, want.logits, rtol=0, atol=0)


def test_shims_in_half_precision(half):
    from torchlens_shims.baukit import TraceDict
    from torchlens_shims.nnsight import NNsight

    model, ids, dtype = half
    with TraceDict(model, ["transformer.h.0.mlp"]) as td:
        model(ids)
    hooked, _ = hook_reads(model, (ids,))
    torch.testing.assert_close(td["transformer.h.0.mlp"].output, hooked["transformer.h.0.mlp"][0], rtol=0, atol=0)
    wrapped = NNsight(model)
    with wrapped.trace(ids):
        wrapped.transformer.h[0].mlp.output[:, -1, :] = 0.0
        logits = wrapped.output.logits.save()

    def zero_last(o):
        o = o.clone()
        o[:, -1, :] = 0.0
        return o

    want = edited_forward(model, "transformer.h.0.mlp", zero_last, (ids,))
    assert logits.dtype == dtype
    torch.testing.assert_close(logits, want.logits, rtol=0, atol=0)


def test_facets_upcast_scores_and_return_the_model_dtype(half):
    model, ids, dtype = half
    trace = tl.trace(model, ids)
    site = trace.find_sites(tl.func("scaled_dot_product_attention")).first()
    facets = site.facets
    assert facets.pattern.dtype == dtype
    torch.testing.assert_close(facets.pattern.as_subclass(torch.Tensor).float().sum(-1),
                               torch.ones(facets.pattern.shape[:-1]), rtol=0, atol=FACET_ATOL[dtype])
    torch.testing.assert_close(facets.head_out.as_subclass(torch.Tensor).float(), site.out.float(), rtol=0,
                               atol=FACET_ATOL[dtype])
