"""``tl.mechinterp``: attention-head patching on fused and eager attention.

The implementation lives in :mod:`torchlens.analysis.heads`; this module is the public name.
"""

from .analysis.heads import HeadPatch, attention_at, head_edit, patch_head

__all__ = ["HeadPatch", "attention_at", "head_edit", "patch_head"]
