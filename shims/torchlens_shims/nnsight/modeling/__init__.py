"""nnsight's ``nnsight.modeling`` package: the model wrappers, by the module nnsight keeps each in.

``modeling.transformers`` (`TransformersModel`), ``modeling.language`` (`LanguageModel`),
``modeling.huggingface``, ``modeling.base`` (`NNsight`), ``modeling.processing`` and
``modeling.vllm`` (a typed refusal). The package itself offers the two wrappers too.
"""

from __future__ import annotations

from .transformers import Generator, GeneratorEnvoy, LanguageModel, TransformersModel

__all__ = [
    "Generator",
    "GeneratorEnvoy",
    "LanguageModel",
    "TransformersModel",
]
