"""Time real nnsight against the TorchLens nnsight shim on a 12-layer GPT-2.

GPT2Config() defaults with random weights, one CPU thread, seed 0, eval mode,
``ids = torch.arange(64)[None] % 50257``. For each case both tools run the same
trace body; each of ``--reps`` repetitions (after 2 warm-ups) times the plain forward under
``torch.no_grad()`` and then both tools back to back, alternating which goes
first, so drift and load from elsewhere hit every side alike. One JSON line per
tool and case gives the median ms, ``base_ms`` (median plain forward) and
``ratio``, the median of the per-repetition ratios tool / plain forward; the
shim's line adds ``vs_nnsight``, the median of the per-repetition ratios
shim / nnsight (below 1: the shim was faster).

Neither tool disables autograd inside a trace (nnsight leaves grad mode alone so
``.backward()`` works on what the body reads), so ``ratio`` includes the cost of
recording the autograd graph, which ``base_ms`` does not.

``ok`` checks each tool's values against a plain ``register_forward_hook``
read/edit of the same model (atol 1e-5).

Usage: python bench/bench_nnsight_shim.py [--quick] [--reps N]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings

import torch
import transformers

warnings.filterwarnings("ignore")
NNSIGHT, SHIM = "nnsight", "torchlens_shims.nnsight"
NOTE = "trace runs with autograd on (as nnsight does); base_ms is the forward under torch.no_grad()"


def local_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", "the", "a"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )


def build() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    ids = torch.arange(64)[None] % 50257
    return model, ids


# -- reference values with plain forward hooks -------------------------------------------------
def reference(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    blocks = model.transformer.h
    out: dict = {}
    seen: dict = {}
    handles = [
        b.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o.detach().clone()))
        for i, b in enumerate(blocks)
    ]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    out["c3"] = seen[5]
    out["c4"] = [seen[i] for i in range(12)]

    def double_last(m, a, o):
        o = o.clone()
        o[:, -1, :] *= 2
        return o

    handle = blocks[8].register_forward_hook(double_last)
    with torch.no_grad():
        out["c5"] = model(ids).logits
    handle.remove()

    def zero_row(row):
        def hook(m, a, o):
            o = o.clone()
            o[row, -1, :] = 0
            return o

        return hook

    handles = [blocks[i].register_forward_hook(zero_row(i)) for i in range(12)]
    with torch.no_grad():
        logits = model(ids.repeat(12, 1)).logits
    for h in handles:
        h.remove()
    out["c8"] = torch.stack([logits[i, -1, 0] for i in range(12)])
    return out


# -- the cases, written once per tool ------------------------------------------------------------
def make_cases(lib, model_nn, model_tm, ids):
    def c3():
        with model_nn.trace(ids):
            h = model_nn.transformer.h[5].output.save()
        return h

    def c4():
        with model_nn.trace(ids):
            hs = lib.save([])
            for block in model_nn.transformer.h:
                hs.append(block.output)
        return hs

    def c5():
        with model_nn.trace(ids):
            model_nn.transformer.h[8].output[:, -1, :] *= 2
            logits = model_nn.output.logits.save()
        return logits

    def c8():
        with model_tm.trace() as tracer:
            scores = lib.save([])
            for layer in range(12):
                with tracer.invoke(ids):
                    model_tm.transformer.h[layer].output[:, -1, :] = 0
                    scores.append(model_tm.output.logits[0, -1, 0])
        return torch.stack(scores)

    return {"c3": c3, "c4": c4, "c5": c5, "c8": c8}


def check(case: str, value, ref) -> bool:
    if case == "c4":
        return len(value) == 12 and all(torch.allclose(v.detach(), r, atol=1e-5) for v, r in zip(value, ref))
    return torch.allclose(value.detach(), ref, atol=1e-5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    options = parser.parse_args()
    reps = options.reps or (3 if options.quick else 15)

    import nnsight
    import torchlens_shims.nnsight as shim

    model, ids = build()
    ref = reference(model, ids)
    tok = local_tokenizer()
    tools = {}
    for name, lib in ((NNSIGHT, nnsight), (SHIM, shim)):
        own = copy.deepcopy(model)  # nnsight instruments the module it wraps; keep the tools apart
        tools[name] = make_cases(lib, lib.NNsight(own), lib.TransformersModel(own, tokenizer=tok), ids)

    def plain(batch):
        with torch.no_grad():
            return model(batch)

    batches = {"single": ids, "batch12": ids.repeat(12, 1)}
    for case in ("c3", "c4", "c5", "c8"):
        batch = batches["batch12" if case == "c8" else "single"]
        runners = {"base": lambda batch=batch: plain(batch)}
        runners.update({name: cases[case] for name, cases in tools.items()})
        ok = {name: check(case, runners[name](), ref[case]) for name in tools}
        for run in runners.values():  # second warm-up
            run()
        times: dict[str, list[float]] = {name: [] for name in runners}
        ratios: dict[str, list[float]] = {name: [] for name in tools}
        versus: list[float] = []
        names = list(tools)
        for rep in range(reps):
            # Like common.measure: each rep times the plain forward and then both tools
            # back to back (who goes first alternates), so a burst of load from
            # elsewhere hits every side of a ratio instead of skewing one of them.
            rep_ms = {}
            for name in ["base"] + (names if rep % 2 == 0 else names[::-1]):
                start = time.perf_counter()
                runners[name]()
                rep_ms[name] = (time.perf_counter() - start) * 1000
                times[name].append(rep_ms[name])
            for name in tools:
                ratios[name].append(rep_ms[name] / rep_ms["base"])
            versus.append(rep_ms[SHIM] / rep_ms[NNSIGHT])
        base_ms = statistics.median(times["base"])
        for name in tools:
            row = {
                "tool": name,
                "case": case,
                "ms": round(statistics.median(times[name]), 2),
                "base_ms": round(base_ms, 2),
                "ratio": round(statistics.median(ratios[name]), 3),
                "ok": bool(ok[name]),
                "note": NOTE,
            }
            if name == SHIM:
                row["vs_nnsight"] = round(statistics.median(versus), 4)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
