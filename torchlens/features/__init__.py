"""Feature dictionaries (sparse autoencoders, transcoders) as sites of a trace: read, edit, replay.

``tl.features.as_dictionary(sae)`` wraps any module with ``encode`` / ``decode`` (SAELens ``SAE`` objects
as they are); ``tl.features.load_sae(path)`` reads SAELens's on-disk layout without SAELens.
"""

from .dictionary import FeatureDictionary, SavedSAE, as_dictionary, load_sae
from .display import ContextText, FeatureText, TopFeatures, context_text, feature_text, top_features
from .dla import feature_activations, feature_logit_attrs
from .stats import FeatureStats, SiteFeatureStats, feature_stats, load_feature_stats

__all__ = ["FeatureDictionary", "SavedSAE", "as_dictionary", "load_sae"]
__all__ += ["ContextText", "FeatureText", "TopFeatures", "context_text", "feature_text", "top_features"]
__all__ += ["FeatureStats", "SiteFeatureStats", "feature_activations", "feature_logit_attrs", "feature_stats",
            "load_feature_stats"]
