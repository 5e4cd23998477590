"""Activation datasets: tokens/s and peak RSS of caching 3 block outputs of GPT-2 small.

Cases (each in its own child process, so peak RSS is per case):
  hooks  a hand-written loop: forward hooks, the same safetensors shards written with safetensors
  local  tl.cache_activations(..., backend="local")
  whole  the same with stop_early=False: every forward runs to the logits, as the hand loop does
  ray    tl.cache_activations(..., backend="ray") with 2 single-thread workers (local Ray, num_cpus=2)
GPT-2 small (random weights), rows of 128 tokens, batch 16, 64 MB shards. ``ratio`` is the job's
time over a plain forward of the same batches in the same process (hooks/local: < ~1.1 is the
target; ray: below 1 means faster than one plain forward thread). The local case also runs at a
quarter of the rows, to show its peak RSS does not grow with the dataset.

    python bench/bench_datasets.py              # 2,000 rows (slow: ~40 min on 2 cores)
    python bench/bench_datasets.py --rows 500   # another row count
    python bench/bench_datasets.py --quick      # 96 rows
"""

from __future__ import annotations

import json
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

import common

SITES = ["transformer.h.3", "transformer.h.6", "transformer.h.9"]
SEQ, BATCH, SHARD = 128, 16, 64 * 10**6


def rows(n: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 50257, (n, SEQ), generator=g).tolist()


def plain_ms(model, data) -> float:
    """A plain forward over every batch: the median of 4 batches, times the batch count."""
    import torch

    batches = [torch.tensor(data[i:i + BATCH]) for i in range(0, min(len(data), 4 * BATCH), BATCH)]
    times = []
    with torch.no_grad():
        model(batches[0])
        for b in batches:
            t0 = time.perf_counter()
            model(b)
            times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return times[len(times) // 2] * (len(data) + BATCH - 1) // BATCH


def hand_loop(model, data, out: pathlib.Path) -> None:
    """What users write today: hooks, buffers, save_file per shard (no resume, no checks)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    seen: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(s).register_forward_hook(
        lambda m, a, o, s=s: seen.__setitem__(s, o if isinstance(o, torch.Tensor) else o[0])) for s in SITES]
    buf: dict[str, list[torch.Tensor]] = {k: [] for k in ["row", "position", "token", *SITES]}
    size, index = 0, 0
    width = 3 * 768 * 4 + 3 * 8
    try:
        with torch.no_grad():
            for i in range(0, len(data), BATCH):
                ids = torch.tensor(data[i:i + BATCH])
                model(ids)
                n, t = ids.shape
                buf["row"].append(torch.arange(i, i + n).repeat_interleave(t))
                buf["position"].append(torch.arange(t).repeat(n))
                buf["token"].append(ids.reshape(-1))
                for s in SITES:
                    buf[s].append(seen[s].reshape(n * t, -1).clone())
                size += n * t * width
                if size >= SHARD or i + BATCH >= len(data):
                    save_file({k: torch.cat(v) for k, v in buf.items()}, str(out / f"shard-{index:05d}.safetensors"))
                    buf = {k: [] for k in buf}
                    size, index = 0, index + 1
    finally:
        for h in handles:
            h.remove()


def child(case: str, n: int, out: str) -> None:
    import torch

    import torchlens as tl

    common.setup()
    model, _ = common.gpt2_small()
    data = rows(n)
    ok, startup = True, 0.0
    if case == "ray":
        import ray  # optional: only this case needs it

        t0 = time.perf_counter()  # starting the local cluster is reported apart (a cluster is usually up)
        ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False)
        startup = time.perf_counter() - t0
    # The job runs first, so the process's peak RSS is the job's (the plain forward of the
    # base keeps full logits of a batch: 16 x 128 x 50257 floats).
    t0 = time.perf_counter()
    if case == "hooks":
        hand_loop(model, data, pathlib.Path(out))
    else:
        kwargs = ({"backend": "ray", "num_workers": 2, "threads_per_worker": 1} if case == "ray"
                  else {"stop_early": False} if case == "whole" else {})
        ds = tl.cache_activations(model, data, SITES, out=out, batch_size=BATCH, shard_size=SHARD,
                                  progress=False, **kwargs)
    ms = (time.perf_counter() - t0) * 1000
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if case != "hooks":
        seen, _ = common.hook_read(model, SITES[1], torch.tensor(data[-1:]))
        ok = common.close(ds.tensor(SITES[1])[-SEQ:], (seen if isinstance(seen, torch.Tensor) else seen[0])[0])
    if case == "ray":
        ray.shutdown()
    base = plain_ms(model, data)
    print(json.dumps({"tool": "torchlens" if case != "hooks" else "hooks", "case": f"datasets_{case}_{n}rows",
                      "ms": round(ms, 1), "base_ms": round(base, 1), "ratio": round(ms / base, 3), "ok": bool(ok),
                      "tokens_per_s": round(n * SEQ / ms * 1000, 1), "peak_rss_mb": round(rss, 1),
                      "note": f"peak RSS of the driver process; ray.init {startup:.1f} s not in ms" if case == "ray"
                      else ""}), flush=True)


def main() -> None:
    if "--child" in sys.argv:
        _, case, n, out = sys.argv[sys.argv.index("--child"):][:4]
        child(case, int(n), out)
        return
    n = 96 if "--quick" in sys.argv else int(sys.argv[sys.argv.index("--rows") + 1]) if "--rows" in sys.argv else 2000
    plan = [("hooks", n), ("local", n), ("whole", n), ("local", n // 4), ("ray", n)]
    results = {}
    for case, rows_n in plan:
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run([sys.executable, __file__, "--child", case, str(rows_n), f"{tmp}/out"],
                                  capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("{")), None)
            if line is None:
                print(json.dumps({"tool": "torchlens", "case": f"datasets_{case}_{rows_n}rows", "ok": False,
                                  "note": proc.stderr[-500:]}))
                continue
            print(line, flush=True)
            results[(case, rows_n)] = json.loads(line)
    tps = {k: v["tokens_per_s"] for k, v in results.items()}
    if ("local", n) in tps and ("hooks", n) in tps and ("ray", n) in tps:
        print(json.dumps({"summary": True, "local_over_hooks": round(tps[("local", n)] / tps[("hooks", n)], 3),
                          "ray_over_local": round(tps[("ray", n)] / tps[("local", n)], 3),
                          "whole_over_hooks": round(tps[("whole", n)] / tps[("hooks", n)], 3)
                          if ("whole", n) in tps else None,
                          "local_rss_mb": {r: results[("local", r)]["peak_rss_mb"] for r in (n // 4, n)
                                           if ("local", r) in results}}))
    common.emit_rss("torchlens")


if __name__ == "__main__":
    main()
