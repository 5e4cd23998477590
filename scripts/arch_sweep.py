"""Sweep: capture, validate, replay and canonical names over the model classes transformers ships.

For each model type of the chosen auto mappings (causal LM, masked LM, sequence-to-sequence;
a type already swept under an earlier mapping is skipped), a child process builds a tiny config
in code (2 layers, width 64, 4 heads, 128 tokens; random weights, no hub), and measures:

* ``capture``: ``tl.trace``'s output is bit-equal to a plain forward's;
* ``validate``: ``tl.validate(trace).ok``;
* ``replay``: a fork that zero-ablates ``blocks.0.mlp`` (else the last ``nn.Linear`` of the first
  block) equals a forward with a hook doing the same (``torch.equal``); a typed refusal is listed;
* ``canonical``: ``blocks.L.resid_pre`` / ``attn`` / ``mlp`` / ``resid_post`` read on every block,
  and every structural check of ``torchlens.arch.check_layout`` holds (``resid_mid`` counted apart).

One JSON line per model type; a summary line at the end. One child process at a time probes the
models in turn (imports paid once); one that takes over ``--timeout`` seconds on a model is killed, the
model recorded as a timeout, and a new child goes on after it. ``--markdown FILE ...`` renders sweeps' lines
as the coverage tables of docs/architectures.md; ``--before REV`` also measures the generic adapter at
that git revision, in the same children on the same traces (the "names before" column).

    nice -n 10 ./.run python scripts/arch_sweep.py --before 2bef8c8 --out /tmp/sweep.jsonl
    ./.run python scripts/arch_sweep.py --markdown /tmp/sweep.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from queue import Empty, Queue
from threading import Thread

__all__ = ["MAPPINGS", "OVERRIDES", "TINY", "main", "markdown", "model_types", "probe"]

TINY = {
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2,
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 128, "max_position_embeddings": 64, "n_positions": 64, "word_embed_proj_dim": 64,
    "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "d_ff": 128, "d_kv": 16, "num_decoder_layers": 2,
}
# per model type: what the tiny config needs to build, or to show its structure in two layers (a hybrid's
# attention layer, an MoE layer past the dense ones)
OVERRIDES = {
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"]},
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"]},
    "olmo_hybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "nemotron_h": {"layers_block_type": ["linear_attention", "full_attention"]},
}
SITES = ("resid_pre", "attn", "mlp", "resid_post")
# mapping name -> transformers constant; sequence-to-sequence models also get decoder_input_ids
MAPPINGS = {"causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
            "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"}


def _tensors(value) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return _tensors(value.to_tuple()) if hasattr(value, "to_tuple") else []


def _same(a, b) -> bool:
    import torch

    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


def _ablation_target(model, view) -> str | None:
    """The module the replay probe ablates: the canonical MLP of block 0, else the first block's last Linear."""
    from torch import nn

    if view is not None:
        try:
            return view.resolve("blocks.0.mlp").partition(":")[0]  # a shared block's pass: every pass
        except Exception:  # noqa: BLE001 - refused: fall back to a real module path
            pass
        block = model.get_submodule(view.blocks[0]) if view.blocks else model
        prefix = view.blocks[0] + "." if view.blocks else ""
    else:
        block, prefix = model, ""
    linears = [n for n, m in block.named_modules() if isinstance(m, nn.Linear)]
    return prefix + linears[-1] if linears else None


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def probe(model_type: str, class_name: str, mapping: str, names_only: bool = False,
          before_generic: str | None = None) -> dict:
    """Build one model type and measure capture / validate / replay / canonical names (in a child process).

    With ``before_generic`` (a path to an earlier ``adapters/generic.py``), also whether that adapter's view
    reads and checks out on the same trace (``before``), for models the generic adapter serves.
    """
    import torch
    import transformers

    import torchlens as tl
    torch.set_num_threads(1)
    row: dict = {"model_type": model_type, "class": class_name, "mapping": mapping}
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **OVERRIDES.get(model_type, {})})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config).eval()
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    kwargs = {"decoder_input_ids": torch.tensor([[1, 4, 6]])} if mapping == "seq2seq" else {}
    with torch.no_grad():
        want = model(ids, **kwargs)
    try:
        view = tl.arch(model)
        row["adapter"] = view.adapter
    except Exception as exc:  # noqa: BLE001 - the sweep records every failure by name
        view = None
        row.update(adapter=None, arch_error=_err(exc))
    try:
        trace = tl.trace(model, ids, **kwargs)
    except Exception as exc:  # noqa: BLE001
        row.update(capture=False, capture_why=_err(exc))
        return row
    row["capture"] = _same(trace.output, want)
    if not names_only:
        try:
            report = tl.validate(trace)
            row["validate"] = bool(report.ok)
            if not report.ok:
                first = report.first_divergence
                row["validate_why"] = report.status + (f": {first}" if first else "")
        except Exception as exc:  # noqa: BLE001
            row.update(validate=False, validate_why=_err(exc))
        target = _ablation_target(model, view)
        row["replay_site"] = target
        if target is not None:
            handle = model.get_submodule(target).register_forward_hook(
                lambda m, a, o: (torch.zeros_like(o[0]), *o[1:]) if isinstance(o, tuple) else torch.zeros_like(o))
            try:
                with torch.no_grad():
                    hooked = model(ids, **kwargs)
            finally:
                handle.remove()
            try:
                forked = trace.fork("ablate").do(tl.module(target), tl.zero_ablate())
                row["replay"] = _same(forked.output, hooked)
                if not row["replay"]:
                    row["replay_why"] = "differs from the hooked forward"
            except Exception as exc:  # noqa: BLE001 - a typed refusal is listed, not counted
                row.update(replay=False, replay_why=_err(exc))
    if view is not None:
        row.update(_names(trace, view, lambda name: trace.find_sites(tl.module(name)).first().out))
    if before_generic and row.get("adapter") in ("generic", None):  # family adapters did not change
        try:
            old = _load_generic(before_generic).view(model)
            row["before"] = _names(trace, old, lambda name: trace.find_sites(old.selector(name)).first().out)[
                "canonical"]
        except Exception as exc:  # noqa: BLE001 - the old rules refused the model
            row.update(before=False, before_why=_err(exc))
    return row


def _load_generic(path: str):
    """The generic adapter as it was at ``--before`` (its file, imported beside today's torchlens.arch)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("generic_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GenericAdapter()


def _names(trace, view, read) -> dict:
    """Read every canonical site of ``view`` on every block and run ``check_layout``: the row's name columns."""
    from torchlens.arch import KINDS, check_layout

    row: dict = {}
    status: dict[str, list[str]] = {}
    for kind in KINDS:
        status[kind] = []
        for i in range(view.n_layers):
            target = view.targets.get(f"blocks.{i}.{kind}", "")
            if isinstance(target, str):  # absent by the block's structure
                status[kind].append("absent")
                if target and kind in SITES:
                    row.setdefault(f"{kind}_why", "absent: " + target[:180])
                continue
            try:
                read(f"blocks.{i}.{kind}")
                status[kind].append("ok")
            except Exception as exc:  # noqa: BLE001
                status[kind].append("error")
                row.setdefault(f"{kind}_why", _err(exc))
    # a block mixes tokens through attention or a mixer; an MLP is read, or absent by structure (Mamba)
    mixes = [a == "ok" or m == "ok" for a, m in zip(status["attn"], status["mixer"], strict=True)]
    row.update(resid_pre=all(s == "ok" for s in status["resid_pre"]), attn=all(mixes),
               mlp=all(s != "error" for s in status["mlp"]) and "ok" in status["mlp"] + status["mixer"],
               resid_post=all(s == "ok" for s in status["resid_post"]),
               resid_mid=all(s == "ok" for s in status["resid_mid"]))
    if all(mixes):
        row.pop("attn_why", None)
    if row["mlp"]:
        row.pop("mlp_why", None)
    try:
        rows = [(what, holds) for what, holds, _ in check_layout(trace, view) if "resid_mid" not in what]
        # a router / experts / cross-attention site whose check fails is refused by name; the core names stand
        row["roles_refused"] = sorted({w.split()[0] for w, h in rows if not h and w.split()[0].split(".")[-1]
                                       in ("router", "experts", "cross_attn")})
        failed = [w for w, h in rows if not h and w.split()[0] not in row["roles_refused"]]
    except Exception as exc:  # noqa: BLE001
        failed = [_err(exc)]
    if failed:
        row["checks_failed"] = failed[:3]
    row["roles"] = [k for k in KINDS[5:] if "ok" in status[k]]
    if not row.get("roles_refused"):
        row.pop("roles_refused", None)
    row["canonical"] = all(row[k] for k in SITES) and not failed
    return row


def model_types(mappings: list[str]) -> list[tuple[str, str, str]]:
    """(model type, class name, mapping) for each mapping in order, a type swept once."""
    from transformers.models.auto import modeling_auto

    seen: set[str] = set()
    out = []
    for mapping in mappings:
        for model_type, class_name in getattr(modeling_auto, MAPPINGS[mapping]).items():
            if model_type in seen:
                continue
            seen.add(model_type)
            out.append((model_type, class_name if isinstance(class_name, str) else class_name[0], mapping))
    return out


def _summary(rows: list[dict]) -> dict:
    built = [r for r in rows if "build_error" not in r]
    count = Counter()
    for r in built:
        for key in ("capture", "validate", "replay", "canonical", "resid_mid"):
            count[key] += bool(r.get(key))
        count["before"] += bool(r.get("before", r.get("canonical") if r.get("adapter") != "generic" else False))
    return {"summary": True, "model_types": len(rows), "built": len(built), **count}


RUN_KEYS = ("capture", "capture_why", "validate", "validate_why", "replay", "replay_why", "replay_site")


def _load(paths: list[str]) -> dict[str, dict]:
    """Rows of several sweeps, by model type: a later row wins (a rerun with a longer time limit, a names-only
    pass after a rule changed), keeping an earlier row's capture / validate / replay where it has none, and
    never replacing a built row with a failure to build."""
    merged: dict[str, dict] = {}
    for path in paths:
        with open(path) as f:
            for row in (json.loads(line) for line in f if line.startswith("{")):
                if "summary" in row:
                    continue
                old = merged.get(row["model_type"])
                if old is not None and "build_error" in row and "build_error" not in old:
                    continue
                if old is not None and "build_error" not in old:
                    row = {**{k: old[k] for k in RUN_KEYS if k in old}, **row}
                merged[row["model_type"]] = row
    return merged


def _mark(row: dict | None, key: str) -> str:
    if row is None or "build_error" in row:
        return "-"
    if key == "canonical" and "arch_error" in row:
        return "no"
    if key not in row:
        return "n/a"
    return "yes" if row[key] else "no"


def _before(row: dict) -> str:
    """The names-before cell: measured with the earlier generic adapter, or (a family adapter) as after."""
    if "before" in row:
        return "yes" if row["before"] else "no"
    return _mark(row, "canonical") if row.get("adapter") not in ("generic", None) else "n/a"


def _why(row: dict) -> str:
    why = (row.get("arch_error") or next((row[f"{k}_why"] for k in SITES if f"{k}_why" in row), "")
           or "; ".join(row.get("checks_failed", [])))
    return why.replace("|", "/")[:150]


def _roles(row: dict) -> str:
    refused = [r.split(".")[-1] for r in row.get("roles_refused", [])]
    roles = [r for r in row.get("roles", []) if r not in refused]
    return ", ".join(roles + [f"{r} refused" for r in dict.fromkeys(refused)])


def markdown(paths: list[str]) -> str:
    """The coverage tables of sweeps (merged as ``_load`` says): counts per mapping (names before and after),
    then one row per model, then the models the tiny configs did not build."""
    rows = _load(paths)
    out = ["| mapping | model types | built | capture | validate | replay | names before | names after |",
           "|---|---|---|---|---|---|---|---|"]
    for mapping in [*MAPPINGS, "all"]:
        group = [r for r in rows.values() if mapping in ("all", r.get("mapping"))]
        built = [r for r in group if "build_error" not in r]
        counts = [sum(bool(r.get(k)) for r in built) for k in ("capture", "validate", "replay")]
        before = sum(_before(r) == "yes" for r in built)
        after = sum(bool(r.get("canonical")) for r in built)
        out.append(f"| {mapping} | {len(group)} | {len(built)} | " + " | ".join(map(str, counts))
                   + f" | {before} | {after} |")
    out += ["", "| model type | mapping | adapter | capture | validate | replay | names before | names after | "
            "resid_mid | roles | why not (names) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model_type, row in sorted(rows.items()):
        if "build_error" in row:
            continue
        why = "" if row.get("canonical") else _why(row)
        out.append(f"| {model_type} | {row['mapping']} | {row.get('adapter') or '-'} | {_mark(row, 'capture')} | "
                   f"{_mark(row, 'validate')} | {_mark(row, 'replay')} | {_before(row)} | {_mark(row, 'canonical')} "
                   f"| {_mark(row, 'resid_mid')} | {_roles(row)} | {why} |")
    skipped = sorted((t, r["build_error"]) for t, r in rows.items() if "build_error" in r)
    out += ["", f"Not built from the tiny config ({len(skipped)}): "
            + "; ".join(f"`{t}` ({why.replace('|', '/')[:80]})" for t, why in skipped) + "."]
    return "\n".join(out)


def _pump(child: subprocess.Popen, queue: Queue) -> None:
    for line in child.stdout:
        queue.put(line)
    queue.put(None)


def _run(todo: list[tuple[str, str, str]], timeout: float, flags: list[str]):
    """Probe each model type in turn, one at a time, in a child process that serves several (the imports are
    paid once); a child that hangs past ``timeout`` on one model is killed and the next child goes on after it."""
    queue: Queue = Queue()
    while todo:
        cmd = [sys.executable, __file__, "--batch", *flags]
        child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        child.stdin.write(json.dumps(todo) + "\n")
        child.stdin.flush()
        Thread(target=_pump, args=(child, queue), daemon=True).start()
        current, done = None, 0
        while True:
            try:
                line = queue.get(timeout=timeout + 60 if current is None else timeout)
            except Empty:
                line = "TIMEOUT"
            if line is None or line == "TIMEOUT":
                child.kill()
                child.wait()
                while not queue.empty():  # the reader thread's leftovers
                    queue.get()
                if current is not None:
                    why = "timeout" if line == "TIMEOUT" else "child died: " + child.stderr.read()[-200:].strip()
                    yield {"model_type": current[0], "mapping": current[2], "build_error": why}
                    done += 1
                todo = todo[done:]
                break
            if line.startswith("START "):
                current = next(t for t in todo if t[0] == line[6:].strip())
            elif line.startswith("{"):
                yield json.loads(line)
                done, current = done + 1, None
                if done == len(todo):
                    child.kill()
                    child.wait()
                    return


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mappings", default="causal_lm,masked_lm,seq2seq")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--only", default=None, help="comma-separated model types")
    parser.add_argument("--timeout", type=float, default=90)
    parser.add_argument("--names-only", action="store_true", help="skip validate and replay")
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    parser.add_argument("--child", nargs=3)
    parser.add_argument("--batch", action="store_true", help="(internal) probe the JSON list on stdin in turn")
    parser.add_argument("--markdown", nargs="+", default=None,
                        help="render sweeps' JSON lines (later files win per model) as the coverage tables")
    parser.add_argument("--before", default=None, help="git revision whose adapters/generic.py is measured too")
    parser.add_argument("--before-file", default=None, help="(internal) that file, extracted")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(probe(*args.child, names_only=args.names_only, before_generic=args.before_file)))
        return
    if args.batch:
        for model_type, class_name, mapping in json.loads(sys.stdin.readline()):
            print("START " + model_type, flush=True)
            try:
                row = probe(model_type, class_name, mapping, names_only=args.names_only,
                            before_generic=args.before_file)
            except Exception as exc:  # noqa: BLE001 - the plain forward (or the tiny config) failed: not built
                row = {"model_type": model_type, "mapping": mapping, "build_error": _err(exc)}
            print(json.dumps(row), flush=True)
        return
    if args.markdown:
        print(markdown(args.markdown))
        return
    todo = model_types(args.mappings.split(","))
    if args.only:
        keep = set(args.only.split(","))
        todo = [t for t in todo if t[0] in keep]
    rows = []
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 - appended line by line as children finish
    flags = ["--names-only"] if args.names_only else []
    if args.before_file:
        flags += ["--before-file", args.before_file]
    if args.before:  # the generic adapter at that revision, measured in the same children on the same traces
        path = os.path.join(tempfile.mkdtemp(prefix="arch_sweep_"), "generic_before.py")
        with open(path, "w") as f:
            f.write(subprocess.run(["git", "show", f"{args.before}:adapters/generic.py"], check=True,
                                   capture_output=True, text=True, cwd=os.path.dirname(__file__)).stdout)
        flags += ["--before-file", path]
    for row in _run(todo[: args.limit], args.timeout, flags):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out:
            print(json.dumps(row), file=out, flush=True)
    print(json.dumps(_summary(rows)), flush=True)
    if out:
        print(json.dumps(_summary(rows)), file=out, flush=True)
        out.close()


if __name__ == "__main__":
    main()
