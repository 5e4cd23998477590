"""Dialects of other interpretability libraries, translated onto TorchLens capture.

Porting code is one changed import line: ``from torchlens_shims.nnsight import NNsight``
or ``from torchlens_shims.baukit import Trace``.
"""

__all__ = []
