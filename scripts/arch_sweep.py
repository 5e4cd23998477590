"""Sweep: on how many causal-LM model types do the canonical sites resolve?

For each model type of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (in order, the
first ``--limit``), a child process builds a tiny config in code (2 layers, width 64, 4 heads,
128 tokens; random weights, no hub), traces one forward with ``tl.trace`` and reads
``blocks.L.resid_pre`` / ``attn`` / ``mlp`` / ``resid_post`` (and ``resid_mid``) for every
block. One JSON line per model type; a summary line at the end.

    bash .run python scripts/arch_sweep.py --limit 40 > /tmp/arch_sweep.log 2>&1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

__all__ = ["TINY", "main", "probe"]

TINY = {
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2,
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 128, "max_position_embeddings": 64, "n_positions": 64, "word_embed_proj_dim": 64,
    "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
SITES = ("resid_pre", "attn", "mlp", "resid_post")


def probe(model_type: str, class_name: str) -> dict:
    """Build, trace and read the canonical sites of one model type (run in a child process)."""
    import torch
    import transformers

    import torchlens as tl

    row: dict = {"model_type": model_type, "class": class_name}
    config = transformers.AutoConfig.for_model(model_type, **TINY)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config).eval()
    try:
        view = tl.arch(model)
    except Exception as exc:  # noqa: BLE001 - the sweep records every failure by name
        row.update(adapter=None, error=f"{type(exc).__name__}: {str(exc)[:200]}")
        return row
    row["adapter"] = view.adapter
    trace = tl.trace(model, torch.tensor([[3, 5, 7, 9, 11]]))
    for kind in (*SITES, "resid_mid"):
        ok, why = True, ""
        for i in range(view.n_layers):
            try:
                trace.find_sites(tl.module(f"blocks.{i}.{kind}")).first().out  # noqa: B018 - the read is the probe
            except Exception as exc:  # noqa: BLE001
                ok, why = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                break
        row[kind] = ok
        if why:
            row[f"{kind}_why"] = why
    row["canonical"] = all(row[k] for k in ("resid_pre", "attn", "mlp"))
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(probe(*args.child)))
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rows = []
    for model_type, class_name in list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())[: args.limit]:
        if not isinstance(class_name, str):
            class_name = class_name[0]
        try:
            done = subprocess.run([sys.executable, __file__, "--child", model_type, class_name],
                                  capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if lines else {"model_type": model_type, "build_error":
                                                        (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
        except subprocess.TimeoutExpired:
            row = {"model_type": model_type, "build_error": "timeout"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    built = [r for r in rows if "build_error" not in r]
    generic = [r for r in built if r.get("adapter") == "generic"]
    print(json.dumps({"summary": True, "model_types": len(rows), "built": len(built),
                      "canonical": sum(bool(r.get("canonical")) for r in built),
                      "generic": len(generic), "generic_canonical": sum(bool(r.get("canonical")) for r in generic),
                      "resid_mid": sum(bool(r.get("resid_mid")) for r in built)}), flush=True)


if __name__ == "__main__":
    main()
