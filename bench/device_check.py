"""Device check: the model zoo, validate, replay and the bench cases on an accelerator.

    python bench/device_check.py              # CUDA when present; otherwise says so and exits 0
    python bench/device_check.py --device cpu # the same checks on CPU (exercises this script)

Per model and dtype it traces on the device, validates (tolerance by dtype, docs/big-models.md),
replays an edit and compares it with a plain-hook edit, captures with
``offload_values="cpu"`` and validates that, then times an every-op trace against a plain
forward. It prints one table; the exit status is 1 when a check failed. Then the encoder
grid (``bench_encoder_grid.py``: BERT-base, 1 x 8 tokens, ``resid_pre`` 12 x 8) on the device,
its cells batched and as sliced forks: the cost per cell in forwards each way, and whether the
two grids agree.
"""

from __future__ import annotations

import copy
import sys
import time

import common

# Replay on an accelerator may pick other kernels than the forward did (docs/big-models.md).
ATOL = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 1e-3}


def _device() -> str | None:
    import torch

    if "--device" in sys.argv:
        return sys.argv[sys.argv.index("--device") + 1]
    return "cuda" if torch.cuda.is_available() else None


def _zoo():
    import torch
    import transformers

    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    yield "tiny_gpt2", transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)), ids, "transformer.h.0"
    yield "tiny_llama", transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=128)), ids, "model.layers.0"
    yield "tiny_bert", transformers.BertModel(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=64)), ids, \
        "encoder.layer.0"
    model, ids = common.gpt2_small()
    yield "gpt2_small", model, ids, "transformer.h.8"


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _ms(fn, device: str, n: int = 3) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]


def _first(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    return value[0]


def check(name: str, model, ids, block: str, device: str, dtype) -> dict:
    import torch

    import torchlens as tl

    model = model.eval().to(device=device, dtype=dtype)
    ids = ids.to(device)
    atol = ATOL[str(dtype).split(".")[-1]]
    row = {"model": name, "dtype": str(dtype).split(".")[-1]}
    trace = tl.trace(model, ids)
    report = tl.validate(trace, atol=atol)
    row["validate"] = "ok" if report.ok else report.summary().splitlines()[0]
    handle = model.get_submodule(block).register_forward_hook(lambda m, i, o: (_first(o) * 2,) + tuple(o[1:])
                                                              if isinstance(o, tuple) else o * 2)
    try:
        with torch.no_grad():
            want = _first(model(ids))
    finally:
        handle.remove()
    got = _first(trace.fork().do(block, tl.scale(2.0)).output)
    row["replay_err"] = float((got.float() - want.float()).abs().max())
    row["replay"] = "ok" if row["replay_err"] <= atol * 10 else "DIFFERS"
    moved = tl.trace(model, ids, offload_values="cpu")
    moved_report = tl.validate(moved, atol=atol)
    row["offload_values"] = "ok" if moved_report.ok else moved_report.status  # NOT OK or NOT FULLY CHECKED
    with torch.no_grad():
        base = _ms(lambda: model(ids), device)
    row["trace_ratio"] = round(_ms(lambda: tl.trace(model, ids), device) / base, 2)
    return row


def encoder_grid(device: str) -> dict:
    """The encoder grid on ``device``, batched cells against sliced forks (float32)."""
    import torch
    from bench_encoder_grid import _feature_diff, bert_prompts

    import torchlens as tl

    model, clean_ids, corrupt_ids = bert_prompts(8)
    model, clean_ids, corrupt_ids = model.to(device), clean_ids.to(device), corrupt_ids.to(device)
    clean, corrupted = tl.trace(model, clean_ids), tl.trace(model, corrupt_ids)
    with torch.no_grad():
        base = _ms(lambda: model(clean_ids), device)
    row, grids = {"model": "bert_base_grid", "dtype": "float32"}, {}
    for batched in (True, False):
        grids[batched] = tl.patching.activation_patching(clean, corrupted, _feature_diff, batched_cells=batched,
                                                         progress=False)
        ms = _ms(lambda batched=batched: tl.patching.activation_patching(
            clean, corrupted, _feature_diff, batched_cells=batched, progress=False), device, n=1)
        row["batched" if batched else "sliced"] = round(ms / base / grids[batched].values.numel(), 3)
    err = float((grids[True].values - grids[False].values).abs().max())
    row["grid"] = "ok" if err <= ATOL["float32"] and not grids[True].notes["cells"]["declined"] else f"DIFFERS {err}"
    return row


def main() -> int:
    device = _device()
    if device is None:
        print("device_check: no accelerator (CUDA) on this machine; nothing to check. "
              "Run with --device cpu to exercise the checks on CPU.")
        return 0
    common.setup()
    import torch

    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    rows = []
    for name, model, ids, block in _zoo():
        for dtype in dtypes:
            if name == "gpt2_small" and dtype is not torch.float32:
                continue  # one large model is enough for the timings
            try:
                rows.append(check(name, copy.deepcopy(model), ids, block, device, dtype))
            except Exception as exc:  # noqa: BLE001 - a failed check is a row of the report, not a crash
                rows.append({"model": name, "dtype": str(dtype).split(".")[-1], "validate": f"error: {exc!r}"[:80]})
    keys = ["model", "dtype", "validate", "replay", "replay_err", "offload_values", "trace_ratio"]
    print(f"device: {device}")
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(str(row.get(k, "")) for k in keys))
    failed = [r for r in rows if any(r.get(k) != "ok" for k in ("validate", "replay", "offload_values"))]
    grid = encoder_grid(device)
    print("model | dtype | grid | per cell batched | per cell sliced (forwards, traces excluded)")
    print(" | ".join(str(grid[k]) for k in ("model", "dtype", "grid", "batched", "sliced")))
    return 1 if failed or grid["grid"] != "ok" else 0


if __name__ == "__main__":
    sys.exit(main())
