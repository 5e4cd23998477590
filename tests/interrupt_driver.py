"""A child process that presses Ctrl-C on itself during one TorchLens operation, then reports.

Run by ``tests/test_interrupts.py`` as ``python tests/interrupt_driver.py DIR OPERATION@POINT ...``:
for each scenario it builds the tiny GPT-2 of ``conftest``, starts ``OPERATION`` (``trace``, ``extract``, ``fork``,
``fork_model``, ``store``, ``dataset``, ``save_trace``, ``save_recipe``) and, at ``POINT``, sends
itself SIGINT (``os.kill(os.getpid(), signal.SIGINT)``, as Ctrl-C does). It catches the
``KeyboardInterrupt`` at top level, then prints one JSON line per scenario with what it finds: whether the model
is as it was (hooks, forward slots, parameters, training flag), whether TorchLens's and torch's
global state is (function modes, grad mode, the garbage collector, copy reductions), what the
artefact on disk does when loaded, and whether the same operation then runs and gives the value a
plain forward hook reads.

Points: ``layer:K`` (in block K's MLP activation, inside the forward), ``enter:N`` / ``exit:N``
(while a capture puts its N-th forward wrapper on, or takes it off), ``op:N`` (replay's N-th
re-issued op), ``write:N`` (mid-way through the bytes of the N-th shard file of a dataset job),
``tensors`` / ``manifest`` / ``swap`` (a save: inside the tensor file, before its manifest, between
the two renames of an overwrite), ``parent`` (print ``ready``, then repeat the operation, each time
in a new directory, until the parent process sends SIGINT).
"""

from __future__ import annotations

import copy
import copyreg
import gc
import json
import os
import pathlib
import signal
import sys
import traceback

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from conftest import TINY_GPT2_IDS, build_tiny_gpt2, global_state, hook_state  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens.capture import _copies, _interpose  # noqa: E402
from torchlens.edit import _strategies  # noqa: E402  (the whole strategy re-issues ops: replay's N-th op)
from torchlens.store import _ondisk, _shards  # noqa: E402

ROWS = [[(3 * i + j) % 60 + 1 for j in range(1 + (i * 5) % 7)] for i in range(12)]
SITES = ["transformer.h.0", "transformer.h.1.mlp"]


def press_ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


class Trigger(nn.Module):
    """Block K's MLP activation, pressing Ctrl-C on its ``at``-th call."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act
        self.at: int | None = None
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.at is not None and self.calls == self.at:
            press_ctrl_c()
        return self.act(x)


PATCHES: list[tuple[object, str, object]] = []  # (owner, name, the real value): undone before the checks


def patch(owner, name: str, value) -> None:
    PATCHES.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def on_nth_call(owner, name: str, n: int, before: bool = True):
    """Make ``owner.name`` press Ctrl-C on its ``n``-th call (before or after running)."""
    real = getattr(owner, name)
    count = [0]

    def wrapped(*args, **kwargs):
        count[0] += 1
        if before and count[0] == n:
            press_ctrl_c()
        result = real(*args, **kwargs)
        if not before and count[0] == n:
            press_ctrl_c()
        return result

    patch(owner, name, wrapped)


def global_measures() -> dict[str, object]:
    """What a capture may leave in torch's or TorchLens's process-wide state, measured."""
    from torch.overrides import _get_current_function_mode_stack

    return {
        "function modes": len(_get_current_function_mode_stack()),
        "global module hooks": global_state()[1:4],
        "grad mode": torch.is_grad_enabled(),
        "garbage collector": gc.isenabled(),
        "active wrappers": len(_interpose.ACTIVE_WRAPPERS),
        "noted slots": len(_copies._PREVIOUS),
        "noted hooks": len(_copies._HOOKS),
        "held types": len(_copies._HELD),
        "copy reductions": sum(v is _copies._reduce for v in copyreg.dispatch_table.values()),
        "SIGINT handler": signal.getsignal(signal.SIGINT),
    }


def first(value):
    return value[0] if isinstance(value, tuple) else value


def hook_read(model: nn.Module, ids: torch.Tensor, address: str) -> torch.Tensor:
    got = []
    handle = model.get_submodule(address).register_forward_hook(
        lambda m, a, out: got.append(first(out).detach().clone()))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    return got[0]


def snapshot(path: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()} if path.is_dir() else {}


def main() -> None:
    """``interrupt_driver.py DIR OPERATION@POINT ...``: each scenario in turn, in a directory of its own
    under DIR, one JSON line each (``parent``: one scenario)."""
    torch.set_num_threads(1)
    # Ctrl-C as an interactive Python gets it (a shell starts background jobs with SIGINT ignored,
    # and a child inherits that: the presses would do nothing).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    work = pathlib.Path(sys.argv[1])
    for i, scenario in enumerate(sys.argv[2:]):
        operation, _, point = scenario.partition("@")
        (work / str(i)).mkdir(parents=True)
        report = run_scenario(operation, point, work / str(i))
        print(json.dumps({"scenario": scenario, **report}), flush=True)


def run_scenario(operation: str, point: str, work: pathlib.Path) -> dict:
    """Build the model, run ``operation`` with Ctrl-C at ``point``, and report what it left."""
    PATCHES.clear()
    model = build_tiny_gpt2()
    ids = torch.tensor(TINY_GPT2_IDS)
    kind, _, arg = point.partition(":")
    layer = int(arg) if kind == "layer" else 1  # call:N: block 1's N-th call
    trigger = Trigger(model.transformer.h[layer].mlp.act)
    model.transformer.h[layer].mlp.act = trigger
    trigger.calls = 0
    before_hooks = hook_state(model)
    before_globals = global_measures()
    before_params = copy.deepcopy(model.state_dict())
    report: dict = {"interrupted": False}
    edit = tl.scale(2.0)
    base = tl.trace(model, ids) if operation in ("fork", "fork_model", "save_trace", "save_recipe") else None
    fork = base.fork("f").do("transformer.h.0", edit) if operation == "save_recipe" else None
    if operation == "fork":
        report["fork_output_before"] = base.fork("g").output.logits.sum().item()
    trigger.calls = 0
    if kind in ("layer", "call"):
        trigger.at = 1 if kind == "layer" else int(arg)
    elif kind in ("enter", "exit"):
        on_nth_call(_interpose, "note_slot" if kind == "enter" else "forget_slot", int(arg))
    elif kind == "op":
        on_nth_call(_strategies, "execute", int(arg))
    elif kind == "write":
        real_open, opened = _shards._open_for_write, [0]

        class HalfWritten:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def fileno(self):
                return self.f.fileno()

            def flush(self):
                self.f.flush()

            def write(self, data):
                self.f.write(bytes(data)[: len(data) // 2])
                press_ctrl_c()

        def opener(p):
            f = real_open(p)
            if p.name.startswith("shard-"):
                opened[0] += 1
                if opened[0] == int(arg):
                    return HalfWritten(f)
            return f

        patch(_shards, "_open_for_write", opener)
    elif kind == "tensors":
        on_nth_call(_ondisk, "write_safetensors", 1, before=False)
    elif kind == "manifest":
        on_nth_call(_ondisk, "_write_manifest", 1)
    elif kind == "swap":
        real_rename = os.rename

        def rename(src, dst):
            real_rename(src, dst)
            if str(dst).endswith(".old"):  # the earlier save moved aside, the new one not yet in place
                press_ctrl_c()

        patch(os, "rename", rename)

    target = work / "out"
    g = None

    def run() -> object:
        nonlocal g
        if operation == "trace":
            return tl.trace(model, ids)
        if operation == "extract":
            return tl.extract(model, ids, ["transformer.h.1"])
        if operation == "store":
            return tl.trace(model, ids, store=target)
        if operation == "fork":
            g = base.fork("g")
            return g.do("transformer.h.0", edit)
        if operation == "fork_model":
            return base.fork("m").do("transformer.h.0", edit, model=model, inputs=ids)
        if operation == "dataset":
            return tl.cache_activations(model, ROWS, SITES, out=target, batch_size=3, shard_size=3000,
                                        progress=False)
        if operation == "save_trace":
            if kind == "swap":
                tl.trace(model, ids[:, :3]).save(target)
                return base.save(target, overwrite=True)
            return base.save(target)
        if operation == "save_recipe":
            if kind == "swap":
                base.fork("h").do("transformer.h.1", edit).save_intervention(target)
                return fork.save_intervention(target, overwrite=True)
            return fork.save_intervention(target)
        raise SystemExit(f"unknown operation {operation}")

    try:
        if kind == "parent":  # the same operation again and again (each in a new directory) until Ctrl-C
            print("ready", flush=True)
            for i in range(100000):
                target = work / f"out{i}"
                run()
        else:
            run()
    except KeyboardInterrupt:
        report["interrupted"] = True
        report["where"] = traceback.format_exc(limit=-3).splitlines()[-4:]
    # -- what the interrupt left ------------------------------------------------------------------------
    trigger.at = None
    for owner, name, real in reversed(PATCHES):
        setattr(owner, name, real)
    report["hooks_left"] = [name for name, state in hook_state(model).items() if state != before_hooks.get(name)]
    after = model.state_dict()
    report["params_equal"] = after.keys() == before_params.keys() and all(
        torch.equal(after[k], before_params[k]) for k in after)
    report["training"] = model.training
    report["globals_left"] = [k for k, v in global_measures().items() if v != before_globals[k]]
    report["artefact"] = artefact(operation, target)
    report["debris"] = sorted(p.name for p in work.iterdir() if p.name.startswith("."))
    report["files"] = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
    if operation == "fork" and g is not None:
        report["fork_output_after"] = g.output.logits.sum().item()
    # -- and the same operation again, uninterrupted ----------------------------------------------------
    try:
        report["again"] = again(operation, model, ids, target, base, edit)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
        report["again"] = f"raised {type(exc).__name__}: {exc}"
    return report


def artefact(operation: str, target: pathlib.Path) -> str:
    """What loading the operation's artefact gives: absent, complete, or a typed refusal."""
    if operation not in ("store", "dataset", "save_trace", "save_recipe"):
        return "none"
    if not target.exists():
        return "absent"
    if operation == "store":  # complete once its index is written; not a save: load_trace refuses it
        leftover = sorted(p.name for p in target.iterdir())
        return "complete" if "trace-store.json" in leftover else "empty" if not leftover else f"left {leftover}"
    load = {"dataset": tl.load_activations, "save_trace": tl.load_trace, "save_recipe": tl.load_intervention}
    try:
        loaded = load[operation](target)
    except tl.errors.TorchLensError as exc:
        return f"refused:{type(exc).__name__}"
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
        return f"raw:{type(exc).__name__}: {exc}"
    if operation == "save_trace":
        return f"complete:{loaded.output.logits.shape[1]} tokens"
    if operation == "save_recipe":
        return f"complete:{[step.site.describe() for step in loaded]}"
    return "complete"


def again(operation: str, model: nn.Module, ids: torch.Tensor, target: pathlib.Path, base, edit) -> str:
    """Run the operation once more without an interrupt and check what it gives against plain hooks."""
    want = hook_read(model, ids, "transformer.h.1")
    if operation in ("trace", "extract", "store"):
        if operation == "store":
            where = target if not target.exists() else target.parent / "again"  # a complete store stays
            got = tl.trace(model, ids, store=where)["transformer.h.1"].out
        elif operation == "extract":
            got = tl.extract(model, ids, ["transformer.h.1"])["transformer.h.1"]
        else:
            got = tl.trace(model, ids)["transformer.h.1"].out
        got = first(got)
        return "ok" if torch.equal(got, want) else "differs"
    if operation in ("fork", "fork_model"):
        edited = []
        handle = model.transformer.h[0].register_forward_hook(
            lambda m, a, out: (out[0] * 2.0, *out[1:]) if isinstance(out, tuple) else out * 2.0)
        try:
            with torch.no_grad():
                edited.append(model(ids).logits)
        finally:
            handle.remove()
        got = base.fork("again").do("transformer.h.0", edit).output.logits
        return "ok" if torch.allclose(got, edited[0], atol=1e-5) else "differs"
    if operation == "dataset":
        ds = tl.cache_activations(model, ROWS, SITES, out=target, batch_size=3, shard_size=3000, progress=False)
        ref = tl.cache_activations(model, ROWS, SITES, out=target.parent / "reference", batch_size=3,
                                   shard_size=3000, progress=False)
        same = snapshot(target) == snapshot(target.parent / "reference")
        return "ok" if same and len(ds) == len(ref) else "differs"
    if operation == "save_trace":
        if target.exists():
            loaded = tl.load_trace(target)
            return "ok" if torch.equal(first(loaded["transformer.h.1"].out), want) else "differs"
        base.save(target)
        return "ok" if torch.equal(first(tl.load_trace(target)["transformer.h.1"].out), want) else "differs"
    if operation == "save_recipe":
        if not target.exists():
            base.fork("r").do("transformer.h.0", edit).save_intervention(target)
        recipe = tl.load_intervention(target)
        return "ok" if len(recipe) == 1 else "differs"
    return "?"


if __name__ == "__main__":
    main()
