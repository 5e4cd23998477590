"""``tl.patching``: activation patching grids, causal tracing (ROME), attribution patching, over features too.

This package owns the patching workflows: :mod:`~torchlens.patching.activation` (exact patching
on sliced replay or batched cells), :mod:`~torchlens.patching.causal` (ROME causal tracing),
:mod:`~torchlens.patching.attribution` (the first-order
estimate), :mod:`~torchlens.patching.metrics` (what a cell measures) and
:mod:`~torchlens.patching.feature_basis` (both over a feature dictionary's features). The logit
lens (:mod:`torchlens.analysis.logit_lens`, also ``tl.logit_lens``) is offered here too, as
TransformerLens users look for it next to patching. See docs/patching.md and docs/features-workflows.md.
"""

from ..analysis.logit_lens import LogitLens, logit_lens
from .activation import BATCHED_TOKENS, CAUSAL_BATCHED_TOKENS, KINDS, PatchingResult, activation_patching, restore_rows
from .attribution import attribution_patching
from .causal import causal_trace
from .feature_basis import feature_attribution_patching, feature_patching, restore_features
from .metrics import MetricReads, logit_diff, prob

__all__ = [
    "BATCHED_TOKENS", "CAUSAL_BATCHED_TOKENS", "KINDS", "LogitLens", "MetricReads", "PatchingResult",
    "activation_patching",
    "attribution_patching", "causal_trace", "feature_attribution_patching", "feature_patching", "logit_diff",
    "logit_lens", "prob", "restore_features", "restore_rows",
]
