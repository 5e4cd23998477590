"""The torchlens command line: inspect, diff, draw and validate saved traces; list plugins; run a demo.

Run "torchlens COMMAND --help" for each command's options; "python -m torchlens" is the same program.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import torchlens as tl

from .analysis.display import selected_ops
from .demo import TinyLM
from .errors import FunctionsNotResolved, InvalidArgumentError, TorchLensError

__all__ = ["EXIT_CHECK_FAILED", "EXIT_ERROR", "EXIT_NOT_FULLY_CHECKED", "EXIT_OK", "EXIT_USAGE", "demo", "main",
           "version_line"]

EXIT_OK = 0  # the command did what was asked (validate: the trace reproduces; diff: no differences)
EXIT_CHECK_FAILED = 1  # validate found divergences / diff found differences / the demo's checks failed
EXIT_USAGE = 2  # bad command line (argparse's own code)
EXIT_ERROR = 3  # a TorchLens error (message and remedy printed) or a file that cannot be read or written
EXIT_NOT_FULLY_CHECKED = 4  # validate: nothing disagreed, but some ops could not be re-issued (listed with why)

EPILOG = """exit codes:
  0  success (validate: the trace reproduces; diff: no differences)
  1  a check failed (validate found divergences, diff found differences)
  2  bad command line
  3  error: a TorchLens error (its message and remedy are printed, no traceback) or an unreadable file
  4  validate: nothing disagreed, but not fully checked (ops that could not be re-issued are listed)
"""


def demo() -> int:
    """Trace the built-in TinyLM, print block 0's ops, zero-ablate an MLP on a fork, validate.

    Returns:
        the exit code: 0 when the replayed fork matches a real edited forward and validation passes.
    """
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
    print("\nDraw it: trace.draw('graph.svg'), or save it and run: torchlens draw SAVED_DIR -o graph.svg")
    return EXIT_OK if agree and report.ok else EXIT_CHECK_FAILED


# -- helpers ------------------------------------------------------------------------------------


def version_line() -> str:
    """What ``torchlens --version`` prints: the version, which project this is and the package's directory.

    PyPI's ``torchlens`` is a different, older project: the description and the path tell them apart.
    """
    return (f"torchlens {tl.__version__} (TorchLens: read, edit, replay and compare the activations of PyTorch "
            f"models; not the older PyPI project named torchlens)\nimported from {Path(tl.__file__).parent}")


def _saved_kind(path: str) -> str:
    """"trace" or "recipe", from the save's manifest (anything unreadable: "trace", whose loader says why)."""
    try:
        with open(Path(path) / "manifest.json", encoding="utf-8") as f:
            kind = json.loads(f.read(1 << 20)).get("kind")
    except (OSError, ValueError, AttributeError):
        return "trace"
    return "recipe" if kind == "recipe" else "trace"


def _load_trace(path: str) -> Any:
    if _saved_kind(path) == "recipe":
        raise InvalidArgumentError(f"{path} is a saved recipe (.tlspec), not a saved trace",
                                   remedy="Pass a directory written by trace.save(path); inspect shows recipes.")
    return tl.load_trace(path)


def _depth(text: str) -> int | str | None:
    if text == "auto":
        return "auto"
    if text == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"depth is a positive number, 'auto' or 'all', not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("depth must be at least 1")
    return value


def _factory(spec: str) -> Callable[[], Any]:
    """``package.module:callable`` or ``path/to/file.py:callable``."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise InvalidArgumentError(f"--model {spec!r} is not MODULE:CALLABLE",
                                   remedy="Write --model my_package.models:build or --model path/to/file.py:build.")
    try:
        if where.endswith(".py"):
            loader_spec = importlib.util.spec_from_file_location(Path(where).stem, where)
            if loader_spec is None or loader_spec.loader is None:
                raise ImportError(f"cannot load {where}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except (ImportError, OSError) as exc:
        raise InvalidArgumentError(f"cannot import {where!r} for --model: {exc}",
                                   remedy="Check the module path (and PYTHONPATH) or give a .py file path.") from exc
    factory = getattr(module, name, None)
    if not callable(factory):
        raise InvalidArgumentError(f"{where!r} has no callable {name!r} for --model",
                                   remedy="Name a function (or class) that returns the model, e.g. file.py:build.")
    return factory


# -- commands --------------------------------------------------------------------------------------


def _cmd_inspect(args: argparse.Namespace) -> int:
    if _saved_kind(args.path) == "recipe":
        recipe = tl.load_intervention(args.path, check_fingerprint=False)
        model = (recipe.fingerprint or {}).get("class", "any model")
        print(f"recipe {args.path}: {len(recipe)} step(s), level {recipe.level}, made for {model}")
        for i, step in enumerate(recipe.steps):
            print(f"  {i}. {step.site.describe()}: {step.edit!r}")
        return EXIT_OK
    trace = tl.load_trace(args.path)
    limit = None if args.all else args.limit
    # The table first: a selector that matches nothing raises (nearest names in its message) before
    # anything is printed, and a selection prints only its own ops, not the whole trace's summary.
    table = trace.table(args.select, limit)
    if args.select is None:
        model = (trace.fingerprint or {}).get("class", "unknown model")
        kind = "fork" if getattr(trace, "parent", None) is not None else "trace"
        print(f"{kind} {trace.name!r} of {model}: {len(trace.ops)} ops, {len(trace.calls)} module calls, "
              f"outputs {', '.join(trace.output_layers) or '-'}")
        for e in trace.edits:
            print(f"  edit at {e.label}: {e.n_changed} elements changed ({e.how})")
        print()
        print(trace.summary())
        print()
    print(table)
    shown = len(selected_ops(trace, args.select)) if args.select else len(trace.ops)
    if limit is not None and shown > limit:
        print(f"... {shown - limit} more op(s); pass --all to list every op")
    return EXIT_OK


def _cmd_diff(args: argparse.Namespace) -> int:
    a, b = _load_trace(args.a), _load_trace(args.b)
    result = tl.debug.compare(a, b, atol=args.atol, rtol=args.rtol)
    print(result.table(limit=args.limit))
    return EXIT_OK if result.same else EXIT_CHECK_FAILED


def _cmd_draw(args: argparse.Namespace) -> int:
    trace = _load_trace(args.path)
    drawing = trace.draw(args.output, depth=args.depth, focus=args.focus, rolled=args.rolled)
    print(f"wrote {drawing.path}")
    return EXIT_OK


def _cmd_validate(args: argparse.Namespace) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FunctionsNotResolved)
        trace = _load_trace(args.path)
    for w in caught:  # said once, plainly: the report below lists the same ops as not checked
        if issubclass(w.category, FunctionsNotResolved):
            print(f"torchlens validate: warning: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    report = tl.validate(trace, atol=args.atol, rerun=False)
    print(report.summary())
    agrees = report.agrees
    if args.model:
        factory = _factory(args.model)
        if args.seed is not None:
            torch.manual_seed(args.seed)
        model = factory()
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(f"--model {args.model} returned a {type(model).__name__}, not an nn.Module")
        fresh = trace.run(model)
        result = tl.debug.compare(trace, fresh, atol=args.atol, rtol=0.0)
        print("\nsaved trace vs the model's real forward on the saved inputs:")
        print(result.summary())
        agrees = agrees and result.same
    if not agrees:
        return EXIT_CHECK_FAILED
    return EXIT_OK if report.fully_checked else EXIT_NOT_FULLY_CHECKED


def _cmd_plugins(args: argparse.Namespace) -> int:
    rows = [("NAME", "KIND", "VERSION", "ORIGIN")]
    found = tl.plugins()
    rows += [(p.name, p.kind, p.version, p.origin + (f"  ERROR {p.error}" if p.error else "")) for p in found]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3])
    return EXIT_CHECK_FAILED if any(p.error for p in found) else EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    return demo()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``torchlens`` program (every subcommand with its help)."""
    parser = argparse.ArgumentParser(
        prog="torchlens", description="Read, edit, replay and compare the activations of PyTorch models.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print the version, which project this is and where it is installed, and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=description, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    p = command("inspect", "summarise a saved trace or .tlspec recipe",
                "Print a saved trace's summary (per module: ops, parameters, output shape, memory) and its op "
                "table, or a saved recipe's steps. With --select, print only the selected ops; a name that does "
                "not exist prints the nearest names (exit code 3).")
    p.add_argument("path", help="a directory written by trace.save(path) or trace.save_intervention(path)")
    p.add_argument("--select", metavar="SELECTOR", default=None,
                   help="list only the ops of this op label or module address (e.g. transformer.h.0)")
    p.add_argument("--limit", type=int, default=50, help="list at most this many ops (default 50)")
    p.add_argument("--all", action="store_true", help="list every op")
    p.set_defaults(run=_cmd_inspect)

    p = command("diff", "compare two saved traces op by op",
                "Align two saved traces (or forks) op by op and print where they first differ. "
                "Exit code 1 when they differ.")
    p.add_argument("a", help="the first saved trace")
    p.add_argument("b", help="the second saved trace")
    p.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4)")
    p.add_argument("--limit", type=int, default=20, help="list at most this many diverging sites (default 20)")
    p.set_defaults(run=_cmd_diff)

    p = command("draw", "draw a saved trace's graph (SVG, PNG, PDF or DOT)",
                "Draw the executed graph of a saved trace with Graphviz; modules are nested boxes, collapsed "
                "below --depth. The output's suffix picks the format. Needs Graphviz's dot program, except "
                "for a .dot output.")
    p.add_argument("path", help="a directory written by trace.save(path)")
    p.add_argument("-o", "--output", required=True, help="the picture to write: graph.svg, graph.png, .pdf or .dot")
    p.add_argument("--depth", type=_depth, default="auto",
                   help="module nesting level drawn as single nodes: a number, 'auto' (default) or 'all' ops")
    p.add_argument("--focus", metavar="SELECTOR", default=None,
                   help="draw only this module or op at full detail, with its inputs and readers")
    p.add_argument("--rolled", action="store_true", help="draw a module called several times once, with loop edges")
    p.set_defaults(run=_cmd_draw)

    p = command("validate", "replay a saved trace and check it reproduces",
                "Replay every op of a saved trace from its saved inputs and compare with the saved values. "
                "With --model, also build the model and compare the saved trace with its real forward on the "
                "saved inputs. Exit code 1 when anything diverges, 4 when nothing diverges but some ops could not be "
                "re-issued (each listed with its reason).")
    p.add_argument("path", help="a directory written by trace.save(path)")
    p.add_argument("--model", metavar="MODULE:CALLABLE", default=None,
                   help="a factory that returns the model, e.g. my_pkg.models:build or path/to/file.py:build")
    p.add_argument("--seed", type=int, default=None, help="torch.manual_seed before calling the factory")
    p.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5)")
    p.set_defaults(run=_cmd_validate)

    p = command("plugins", "list registered plugins (engines, adapters, helpers, facets)",
                "List every registered plugin with its kind, version and origin package. Exit code 1 when a "
                "plugin is broken.")
    p.set_defaults(run=_cmd_plugins)

    p = command("demo", "trace a small built-in model, print a block's ops, apply an edit",
                "Trace a tiny built-in transformer, print the ops of its first block, zero-ablate an MLP on a "
                "fork, check the replay against a real edited forward, and validate the trace.")
    p.set_defaults(run=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the torchlens command line.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        the exit code (see the module's EXIT_* constants).
    """
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except TorchLensError as exc:
        print(f"torchlens {args.command}: error: {exc.message}", file=sys.stderr)
        if exc.remedy:
            print(f"  remedy: {exc.remedy}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # piped into head: stop quietly (and let the exit-time flush go nowhere)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as exc:
        print(f"torchlens {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
