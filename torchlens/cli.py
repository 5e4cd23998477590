"""``torchlens demo``: trace a small built-in model, show one block's ops, edit, validate."""

from __future__ import annotations

import argparse
import sys

import torch

import torchlens as tl

from ._demo_model import TinyLM

__all__ = ["demo", "main"]


def demo() -> int:
    torch.manual_seed(0)
    model = TinyLM().eval()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])

    trace = tl.trace(model, ids)
    print(f"Traced {type(model).__name__}: {len(trace.ops)} ops, {len(trace.calls)} module calls.\n")
    print("Ops of blocks.0 (label, function, module:pass, shape, model line):")
    print(trace.table(tl.in_module("blocks.0")))

    edited = trace.fork("mlp0-zeroed").do(tl.module("blocks.0.mlp"), tl.zero_ablate())
    before, after = trace.output, edited.output
    print("\nEdit: zero-ablate the output of blocks.0.mlp, replayed downstream on a fork.")
    for e in edited.edits:
        print(f"  applied at {e.label} (pass {e.pass_index}): {e.n_changed} elements changed")
    print(f"  logits max abs change: {(after - before).abs().max().item():.4f}")
    print(f"  next-token argmax per position, before: {before[0].argmax(-1).tolist()}")
    print(f"  next-token argmax per position, after:  {after[0].argmax(-1).tolist()}")

    rerun = tl.trace(model, ids, intervene=tl.when(tl.module("blocks.0.mlp"), tl.zero_ablate()))
    agree = torch.allclose(rerun.output, after, atol=1e-5)
    print(f"  replayed fork == real forward with the edit: {agree}")

    report = tl.validate(trace)
    print("\n" + report.summary())
    return 0 if agree and report.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchlens", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="trace a small built-in model, print a block's ops, apply an edit")
    sub.add_parser("plugins", help="list registered plugins (engines, adapters, helpers, facets)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo()
    if args.command == "plugins":
        for p in tl.plugins():
            print(f"{p.name:45s} {p.kind:18s} {p.version:10s} {p.origin}" + (f"  ERROR {p.error}" if p.error else ""))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
