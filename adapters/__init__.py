"""Architecture adapters: canonical names (blocks, attn, mlp, resid_*) for model families."""

plugin = None
