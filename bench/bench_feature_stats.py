"""Feature statistics over a dataset: ``tl.feature_stats`` against a hand-written hooks loop.

GPT-2 small (random weights), an SAE of 24,576 features (ReLU, seeded random weights) reading
block 6's residual, rows of 128 tokens, batch 16, one CPU thread. Both compute the same statistics
(per feature: firing count, activation sum and max, the 16 max-activating contexts with 8 + 4
surrounding token ids); ``tl.feature_stats`` also writes the sparse activations (the 32 largest per
token) to resumable safetensors shards. Cases, timed alternately in one process (best of 2):

  hooks  the hand loop: a forward hook on block 6, sae.encode, the statistics folded per batch
  local  tl.feature_stats(..., backend="local") (stops each forward after block 6, as it may)
  whole  the same with stop_early=False: every forward runs to the logits, as the hand loop does

``speed`` is hooks time / case time (issue #30's target for local: >= 0.9). Every case's
statistics are checked against the hand loop's.

    python bench/bench_feature_stats.py              # 128 rows (~3 min on one core)
    python bench/bench_feature_stats.py --rows 2000  # the issue's size (slow: ~40 min)
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import common
import torch
from torch import nn

SITE, SEQ, BATCH, D_SAE, TOP_K, LEFT, RIGHT = "transformer.h.6", 128, 16, 24576, 16, 8, 4


class ReluSAE(nn.Module):
    def __init__(self, d_in: int, d_sae: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.W_enc = nn.Parameter(torch.randn(d_in, d_sae, generator=g) / d_in**0.5)
        self.b_enc = nn.Parameter(torch.full((d_sae,), -2.0))  # sparse: a few % of the features fire
        self.W_dec = nn.Parameter(torch.randn(d_sae, d_in, generator=g) / d_sae**0.5)
        self.b_dec = nn.Parameter(torch.zeros(d_in))

    def encode(self, x):
        return torch.relu((x - self.b_dec) @ self.W_enc + self.b_enc)

    def decode(self, f):
        return f @ self.W_dec + self.b_dec


def rows(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 50257, (n, SEQ), generator=g).tolist()


def hand_loop(model, sae, data) -> dict[str, torch.Tensor]:
    """What users write today: a hook, encode, and the statistics folded batch by batch."""
    seen = {}
    handle = model.get_submodule(SITE).register_forward_hook(
        lambda m, a, o: seen.__setitem__("x", o if isinstance(o, torch.Tensor) else o[0]))
    count = torch.zeros(D_SAE, dtype=torch.long)
    total = torch.zeros(D_SAE, dtype=torch.float64)
    mx = torch.full((D_SAE,), float("-inf"))
    top_v = torch.full((D_SAE, TOP_K), float("-inf"))
    top_r = torch.full((D_SAE, TOP_K), -1)
    top_p = torch.full((D_SAE, TOP_K), -1)
    top_t = torch.full((D_SAE, TOP_K, LEFT + 1 + RIGHT), -1, dtype=torch.int32)
    try:
        with torch.no_grad():
            for i in range(0, len(data), BATCH):
                ids = torch.tensor(data[i:i + BATCH])
                model(ids)
                n, t = ids.shape
                codes = sae.encode(seen["x"]).reshape(n * t, D_SAE)
                # the fast spellings (float counts, float32 batch sums, top-k along the transpose's rows)
                count += (codes > 0).to(codes.dtype).sum(0).long()
                total += codes.sum(0).double()
                mx = torch.maximum(mx, codes.amax(0))
                v, j = codes.T.topk(TOP_K, dim=1)
                windows = nn.functional.pad(ids, (LEFT, RIGHT), value=-1).unfold(1, LEFT + 1 + RIGHT, 1)
                windows = windows.reshape(n * t, -1)
                cand_v = torch.cat([top_v, v], 1)
                cand_r = torch.cat([top_r, i + j // t], 1)
                cand_p = torch.cat([top_p, j % t], 1)
                cand_t = torch.cat([top_t, windows[j].int()], 1)
                order = cand_v.sort(dim=1, descending=True, stable=True).indices[:, :TOP_K]
                top_v, top_r, top_p = cand_v.gather(1, order), cand_r.gather(1, order), cand_p.gather(1, order)
                top_t = cand_t.gather(1, order[:, :, None].expand(-1, -1, cand_t.shape[2]))
    finally:
        handle.remove()
    return {"count": count, "total": total, "max": mx, "top_value": top_v, "top_row": top_r}


def main() -> None:
    import torchlens as tl

    common.setup()
    n = int(sys.argv[sys.argv.index("--rows") + 1]) if "--rows" in sys.argv else 128
    model, _ = common.gpt2_small()
    sae = ReluSAE(768, D_SAE).eval()
    data = rows(n)
    with torch.no_grad():  # scale the encoder so pre-activations are ~N(0, 1): b_enc = -2 fires ~2%
        x, _ = common.hook_read(model, SITE, torch.tensor(data[:2]))
        x = x if isinstance(x, torch.Tensor) else x[0]
        sae.W_enc /= float(((x - sae.b_dec) @ sae.W_enc).std())
    times: dict[str, list[float]] = {"hooks": [], "local": [], "whole": []}
    results: dict[str, object] = {}
    for _ in range(2):
        for case in times:
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                if case == "hooks":
                    results[case] = hand_loop(model, sae, data)
                else:
                    results[case] = tl.feature_stats(model, data, {SITE: sae}, out=f"{tmp}/job", batch_size=BATCH,
                                                     top_k=TOP_K, context=(LEFT, RIGHT), progress=False,
                                                     stop_early=case == "local")[SITE]
                times[case].append((time.perf_counter() - t0) * 1000)
    want = results["hooks"]
    for case in ("local", "whole"):
        got = results[case]
        fired = want["count"] > 0
        ok = (torch.equal(got.count, want["count"]) and torch.allclose(got.total, want["total"], rtol=1e-9, atol=1e-3)
              and torch.allclose(got.max[fired], want["max"][fired], atol=1e-5)
              and torch.allclose(got.top_value.clamp(min=0), want["top_value"].clamp(min=0), atol=1e-5))
        best, hooks = min(times[case]), min(times["hooks"])
        print(json.dumps({"tool": "torchlens", "case": f"feature_stats_{case}_{n}x{SEQ}", "ms": round(best, 1),
                          "hooks_ms": round(hooks, 1), "speed": round(hooks / best, 3), "ok": bool(ok),
                          "tokens_per_s": round(n * SEQ / best * 1000, 1),
                          "mean_active": round(float(want["count"].sum()) / (n * SEQ), 1)}), flush=True)
    common.emit_rss("torchlens")


if __name__ == "__main__":
    main()
