"""Feature dictionaries (sparse autoencoders, transcoders) as sites of a trace: read, edit, replay.

``tl.features.as_dictionary(sae)`` wraps any module with ``encode`` / ``decode`` (SAELens ``SAE`` objects
as they are); ``tl.features.load_sae(path)`` reads SAELens's on-disk layout without SAELens;
``tl.trace(model, x, features={site: sae})`` splices them in for one capture (docs/features.md).
Patching in the feature basis is ``tl.patching.feature_patching`` (:mod:`torchlens.patching.feature_basis`).
"""

from ..dictionaries import (
    FeatureAttachment,
    FeatureDictionary,
    FeatureSplice,
    SavedSAE,
    as_dictionary,
    attach,
    dictionaries,
    load_sae,
)
from .display import ContextText, FeatureText, TopFeatures, context_text, feature_text, top_features
from .dla import feature_activations, feature_logit_attrs
from .edits import FeatureEdit, ablate, clamp, scale, steer
from .reads import FeatureList, active, feature_acts, top
from .stats import FeatureStats, SiteFeatureStats, feature_stats, load_feature_stats

__all__ = [
    "FeatureAttachment", "FeatureDictionary", "FeatureEdit", "FeatureList", "FeatureSplice", "SavedSAE", "ablate",
    "active", "as_dictionary", "attach", "clamp", "dictionaries", "feature_acts", "load_sae", "scale", "steer", "top",
]
__all__ += ["ContextText", "FeatureText", "TopFeatures", "context_text", "feature_text", "top_features"]
__all__ += ["FeatureStats", "SiteFeatureStats", "feature_activations", "feature_logit_attrs", "feature_stats",
            "load_feature_stats"]
