"""What feature dictionaries cost (issue 30, rows 1 and 2): GPT-2 small (random weights), 1x64 tokens,
an SAE of 24,576 features (SAELens-layout weights, random, seeded) at block 6's output, one thread.

Row 1: a trace reading the features at that site (``tl.trace(model, ids, features={"blocks.6": sae})``,
then ``trace["blocks.6.features"]``), and the same read with ``tl.extract``; the ratio is to
(plain forward + the SAE's own encode/decode of that activation, measured alone) — target <= 1.05.

Row 2: 100 feature-ablation forks at the last position, reading two logits, per fork as a fraction of a
plain forward — target <= 0.05. Timed three ways: ``trace.forks`` (every fork's full logits kept),
``replay_reads`` (the replay patching metrics use: of the LM head only the two logits read), and a
peer's way (one hooked forward per feature). ``ok`` compares the logits of a sample of forks with a
plain forward whose block-6 hook does the splice by hand (atol 1e-4).

    python bench/bench_features.py [--quick] [--small]   (--small: 4 layers, 2,048 features, 20 forks)

prints one JSON line per case, then the process's peak RSS.
"""

from __future__ import annotations

import sys
import time

import torch
from common import emit, emit_rss, gpt2_small, measure, setup

import torchlens as tl
from torchlens.core.steps import REPLAY, Step
from torchlens.dictionaries.load import SavedSAE
from torchlens.edit.reads import OutputRead, replay_reads

TOOL = "torchlens.features"
SMALL = "--small" in sys.argv


def make_sae(d_in: int, d_sae: int) -> SavedSAE:
    gen = torch.Generator().manual_seed(0)
    w = {"W_enc": torch.randn(d_in, d_sae, generator=gen) / d_in ** 0.5,
         "b_enc": torch.randn(d_sae, generator=gen) * 0.1 - 0.2,
         "W_dec": torch.randn(d_sae, d_in, generator=gen) / d_sae ** 0.5,
         "b_dec": torch.randn(d_in, generator=gen) * 0.1}
    return SavedSAE({"d_in": d_in, "d_sae": d_sae, "architecture": "standard"}, w)


def hand_spliced(model, ids, sae, address: str, feature: int):
    def hook(m, a, out):
        f = sae.encode(out)
        g = f.clone()
        g[..., -1, feature] = 0.0
        return out + (sae.decode(g) - sae.decode(f))

    handle = model.get_submodule(address).register_forward_hook(hook)
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        handle.remove()


def main() -> None:
    setup()
    model, ids = gpt2_small()
    n_forks, d_sae, layer = 100, 24_576, 6
    if SMALL:
        model.transformer.h = model.transformer.h[:4]
        model.config.n_layer = 4
        n_forks, d_sae, layer = 20, 2_048, 2
    site, address = f"blocks.{layer}", f"transformer.h.{layer}"
    sae = make_sae(model.config.n_embd, d_sae)
    with torch.no_grad():
        x = model.get_submodule(address).register_forward_hook(lambda m, a, o: setattr(sae, "_x", o))
        model(ids)
        x.remove()
        act = sae.__dict__.pop("_x")

    def forward():
        with torch.no_grad():
            return model(ids).logits

    def sae_alone():
        with torch.no_grad():
            return sae.decode(sae.encode(act))

    def forward_and_sae():
        forward()
        sae_alone()

    def trace_read():
        t = tl.trace(model, ids, features={site: sae})
        return t[f"{site}.features"].out

    def extract_read():
        return tl.extract(model, ids, [f"{site}.features"], features={site: sae})[f"{site}.features"]

    want = sae.encode(act)
    ok = torch.equal(trace_read(), want) and torch.equal(extract_read(), want)
    ms, base_ms, ratio = measure(trace_read, forward_and_sae)
    emit(TOOL, "row1_trace_read_features", ms, base_ms, ok, "ratio to forward + SAE encode/decode alone", ratio)
    ms, base_ms, ratio = measure(extract_read, forward_and_sae)
    emit(TOOL, "row1_extract_read_features", ms, base_ms, ok, "ratio to forward + SAE encode/decode alone", ratio)
    ms, base_ms, ratio = measure(lambda: tl.trace(model, ids), forward)
    emit(TOOL, "context_trace_without_features", ms, base_ms, True, "every-op capture alone, ratio to a forward",
         ratio)
    fwd_ms, _, _ = measure(forward, forward)
    sae_ms, _, _ = measure(sae_alone, forward)
    emit(TOOL, "sae_encode_decode_alone", sae_ms, fwd_ms, True, "ratio to a plain forward")

    # -- row 2: feature ablations at the last position -----------------------------------------------
    trace = tl.trace(model, ids, features={site: sae})
    feats = trace[f"{site}.features"].out[0, -1]
    firing = torch.nonzero(feats).flatten().tolist()
    chosen = (firing + [i for i in range(d_sae) if i not in set(firing)])[:n_forks]  # firing ones first
    columns = (0, 1)
    edits = [(f"{site}.features", tl.features.ablate(i, positions=-1)) for i in chosen]

    def forks_full():
        forks = trace.forks(edits)
        return [f.output.logits[0, -1, list(columns)] for f in forks]

    logits_ref = trace.output_refs[0]
    read = OutputRead(logits_ref.index, 1, ids.shape[1] - 1, columns)
    bound = trace.bind(f"{site}.features", strings_as_modules=True)

    def forks_read():
        forks = [trace.fork() for _ in edits]
        steps = [Step(bound, e, REPLAY) for _, e in edits]
        return replay_reads(forks, steps, read)

    def peers():  # timed on the first ten features: one forward each
        return [hand_spliced(model, ids, sae, address, i)[0, -1, list(columns)] for i in chosen[:10]]

    sample = [0, len(chosen) // 2, len(chosen) - 1]
    full, red = forks_full(), forks_read()
    refs = {k: hand_spliced(model, ids, sae, address, chosen[k])[0, -1, list(columns)] for k in sample}
    ok = all(torch.allclose(full[k], refs[k], atol=1e-4) and torch.allclose(red[k].reshape(-1), refs[k], atol=1e-4)
             for k in sample)
    log = trace.forks(edits[:1])[0].edits[-1].replay
    note = f"{len(firing)} of the forks' features fire; replay log: {log.n_sliced} ops sliced, " \
           f"{len(log.fallbacks)} fallbacks"
    for case, fn, n in (("row2_forks_full_logits", forks_full, len(chosen)),
                        ("row2_replay_reads_two_logits", forks_read, len(chosen)),
                        ("row2_peer_hooked_forward_per_feature", peers, min(10, len(chosen)))):
        t0 = time.perf_counter()
        fn()
        total = (time.perf_counter() - t0) * 1000
        emit(TOOL, case, total / n, fwd_ms, ok, f"ms per fork over {n} forks; {note}")
    emit_rss(TOOL)


if __name__ == "__main__":
    main()
