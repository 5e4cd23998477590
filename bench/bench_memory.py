"""Memory of big-model captures: peak RSS per case, each case in its own child process.

GPT-2 small with random weights on 1 x 1024 tokens (``--quick``: 1 x 256). Every case reports
``peak_mb``: the process's peak RSS above the warm model (built, one plain forward of the same
input run, as in issue 14's table), ``ms``, and ``ratio``: its peak over the plain forward's own
activation peak (``plain_activation_mb``: the warm-up forward's peak above the cold model). Cases:

  plain          a plain forward (no_grad): the activation peak every ratio is relative to
  trace_all      tl.trace(model, ids): every op value in memory
  save_block     tl.trace(model, ids, save=tl.module("transformer.h.5")): values freed as the forward frees them
  store          tl.trace(model, ids, store=dir): every op value written to safetensors shards as it is produced
                 (the store hands freed memory back at each shard: held_mb may be below the warm model's),
                 except the values recomputed on read (recomputed_mb, recomputed_share: of the bytes the
                 store would otherwise write)
  store_written  the same with store_recompute=False: every value written
                 (both store cases also time an in-memory trace in the same process afterwards:
                 in_memory_ms, time_vs_in_memory_same_process)
  store_save_load  a store= trace, then trace.save(dir) of it and tl.load_trace(dir) in the same process:
                 save_peak_mb / load_peak_mb (VmHWM above the RSS before each step: mapped file pages count)
                 and save_anon_mb / load_anon_mb (process memory, RssAnon, after each step), saved_mb, times
  estimate       the pass over shapes tl.trace(..., max_bytes=n) runs before the forward (FakeTensorMode, no
                 compute): its estimate of the values an every-op trace holds (compare trace_all's values_mb)
  offload_kept   a disk_offload()ed model (1 x 64 tokens), trace with save= one block: RSS held after the
                 capture, with the offloaded weights recorded as references (what TorchLens does) ...
  offload_copy   ... and with the materialised weights left in the recorded arguments (the second copy
                 the references avoid)

    python bench/bench_memory.py [--quick] [--steady-malloc] [--cases trace_all,store,...]

glibc raises its mmap threshold as big blocks are freed, so a freed activation may stay in the heap
and count in RSS: on some machines the plain forward's own repeat peak then varies by 100 MB and
more between runs (288-420 MB seen on one AMD machine). ``--steady-malloc`` runs each child with
``MALLOC_MMAP_THRESHOLD_=65536`` (big blocks always mapped, so unmapped when freed): the peaks
then measure live memory and repeat to a tenth of a MB (plain 271 MB, save_block 275 MB there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

CASES = ["plain", "trace_all", "save_block", "store", "store_written", "store_save_load", "estimate", "offload_kept",
         "offload_copy"]


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Make VmHWM (the peak) restart from the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(case: str, seq: int, tmp: str) -> dict:
    import common

    common.setup()
    import torch

    import torchlens as tl

    model, _ = common.gpt2_small()
    ids = (torch.arange(seq) % 50257)[None]
    out: dict = {"case": case, "seq": seq}
    if case.startswith("offload"):
        import accelerate

        ids = ids[:, :64]
        model = accelerate.disk_offload(model, os.path.join(tmp, "weights"), execution_device=torch.device("cpu"))
        if case == "offload_copy":
            from torchlens.capture import engines

            engines.defer_offloaded_weights = lambda trace, model: 0  # keep what the forward materialised
    # Warm: one plain forward of the same size (lazy imports, kernels, allocator pools). Its own
    # peak above the model is the plain forward's activation peak every ratio is relative to.
    cold = _rss_mb("VmRSS")
    _reset_peak()
    with torch.no_grad():
        model(ids)
    out["plain_activation_mb"] = round(_rss_mb("VmHWM") - cold, 1)
    before = _rss_mb("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    keep = None
    if case == "plain":
        with torch.no_grad():
            model(ids)
    elif case == "trace_all":
        keep = tl.trace(model, ids, max_bytes=None)
    elif case == "save_block" or case.startswith("offload"):
        keep = tl.trace(model, ids, save=tl.module("transformer.h.5"))
    elif case == "store_save_load":
        stored = tl.trace(model, ids, store=os.path.join(tmp, "store"))
        out["store_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        for step in ("save", "load"):
            mid, anon = _rss_mb("VmRSS"), _rss_mb("RssAnon")
            _reset_peak()
            t1 = time.perf_counter()
            if step == "save":
                stored.save(os.path.join(tmp, "saved"))
                stored = None
            else:
                keep = tl.load_trace(os.path.join(tmp, "saved"))
            out[f"{step}_ms"] = round((time.perf_counter() - t1) * 1000, 1)
            out[f"{step}_peak_mb"] = round(_rss_mb("VmHWM") - mid, 1)
            out[f"{step}_anon_mb"] = round(_rss_mb("RssAnon") - anon, 1)
        saved = os.path.join(tmp, "saved")
        out["saved_mb"] = round(sum(os.path.getsize(os.path.join(saved, f)) for f in os.listdir(saved)) / 2**20, 1)
    elif case.startswith("store"):
        where = os.path.join(tmp, "store")
        keep = tl.trace(model, ids, store=where, store_recompute=case == "store")
        out["disk_mb"] = round(sum(os.path.getsize(os.path.join(where, f)) for f in os.listdir(where)) / 2**20, 1)
        with open(os.path.join(where, "trace-store.json")) as f:
            recomputed = json.load(f)["recomputed_bytes"]
        out["recomputed_mb"] = round(recomputed / 2**20, 1)
        out["recomputed_share"] = round(recomputed / (recomputed + out["disk_mb"] * 2**20), 3)
    elif case == "estimate":
        from torchlens.capture._estimate import estimate_capture

        estimate = estimate_capture(model, (ids,), {}, lambda a, k: tl.trace(model, *a, max_bytes=None))
        out["estimate_mb"] = round(estimate.nbytes / 2**20, 1)
    out["ms"] = round((time.perf_counter() - t0) * 1000, 1)
    out["peak_mb"] = round(_rss_mb("VmHWM") - before, 1)
    out["held_mb"] = round(_rss_mb("VmRSS") - before, 1)  # still held once the capture returned
    if keep is not None:
        out["ops"] = len(keep.ops)
        out["values_mb"] = round(keep.nbytes / 2**20, 1)
        if case in ("save_block", "store"):
            # The graph is Python objects (tracemalloc sees them; tensor storage it does not).
            import tracemalloc

            del keep
            tracemalloc.start()
            again = tl.trace(model, ids, save=tl.module("transformer.h.5")) if case == "save_block" else \
                tl.trace(model, ids, store=os.path.join(tmp, "store-again"))
            out["graph_bytes_per_op"] = round(tracemalloc.get_traced_memory()[0] / len(again.ops))
            tracemalloc.stop()
    if case in ("store", "store_written"):
        # The same process times an in-memory capture right after (its peak is no longer measured):
        # a ratio of two captures minutes apart, on a machine shared with other work, varies by 2x.
        keep = again = None  # the stored traces are dropped first
        t0 = time.perf_counter()
        keep = tl.trace(model, ids, max_bytes=None)
        out["in_memory_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        out["time_vs_in_memory_same_process"] = round(out["ms"] / out["in_memory_ms"], 2)
    return out


def main() -> None:
    if "--help" in sys.argv or "-h" in sys.argv:
        print(__doc__)
        return
    if "--child" in sys.argv:
        _, case, seq, tmp = sys.argv[sys.argv.index("--child"):][:4]
        print(json.dumps(child(case, int(seq), tmp)), flush=True)
        return
    seq = 256 if "--quick" in sys.argv else 1024
    here = os.path.dirname(os.path.abspath(__file__))
    results: dict[str, dict] = {}
    cases = sys.argv[sys.argv.index("--cases") + 1].split(",") if "--cases" in sys.argv else CASES
    for case in cases:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536") if "--steady-malloc" in sys.argv else None
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run([sys.executable, os.path.join(here, "bench_memory.py"), "--child", case, str(seq),
                                   tmp], capture_output=True, text=True, cwd=here, env=env)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("{")), None)
        if line is None:
            print(json.dumps({"tool": "torchlens", "case": f"mem_{case}", "ok": False, "note": proc.stderr[-800:]}))
            continue
        results[case] = json.loads(line)
    plain = results.get("plain", {}).get("plain_activation_mb") or float("nan")
    for case, r in results.items():
        r = dict(r)
        note = ""
        if case == "estimate" and "trace_all" in results:
            r["time_vs_in_memory"] = round(r["ms"] / results["trace_all"]["ms"], 2)
            r["estimate_vs_values"] = round(r["estimate_mb"] / results["trace_all"]["values_mb"], 3)
        if case in ("store", "store_written"):
            if "trace_all" in results:
                r["time_vs_in_memory"] = round(r["ms"] / results["trace_all"]["ms"], 2)
            r["disk_mb_per_s"] = round(r["disk_mb"] / (r["ms"] / 1000), 1)
        if case == "save_block":
            # target: peak <= 1.2 x plain peak + saved values + graph
            budget = 1.2 * plain + r["values_mb"] + r["graph_bytes_per_op"] * r["ops"] / 2**20
            r["target_mb"] = round(budget, 1)
            note = "within target" if r["peak_mb"] <= budget else "over target"
        if case in ("store", "store_written"):
            note = "target: peak <= 300 MB above the warm model, time <= 2x the in-memory trace"
        if case.startswith("offload"):
            note = "RSS held after the capture (the trace alive)"
        print(json.dumps({"tool": "torchlens", "case": f"mem_{case}", **r,
                          "ratio": round(r["peak_mb"] / plain, 2), "ok": True, "note": note}), flush=True)


if __name__ == "__main__":
    main()
