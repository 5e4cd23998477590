"""Architecture adapters: canonical names (blocks, attn, mlp, resid_*) for model families.

One module per family, keyed by ``config.model_type``; ``generic`` serves the rest. They
reach TorchLens only through the ``plugin`` object below, named by the entry point
``adapters_builtin = "torchlens_adapters:plugin"`` — exactly how a third party's would.
"""

from __future__ import annotations

from torchlens.hookspecs import hookimpl

from .bert import BertAdapter
from .gemma3 import Gemma3TextAdapter
from .generic import GenericAdapter
from .gpt2 import GPT2Adapter
from .gpt_neox import GPTNeoXAdapter
from .llama import LlamaAdapter

ADAPTERS = (GPT2Adapter, GPTNeoXAdapter, LlamaAdapter, Gemma3TextAdapter, BertAdapter, GenericAdapter)


class BuiltinAdapters:
    """The built-in adapters, registered through the ``torchlens`` entry-point group."""

    @hookimpl
    def torchlens_adapters(self):
        return [cls() for cls in ADAPTERS]


plugin = BuiltinAdapters()


__all__ = ["ADAPTERS", "BertAdapter", "BuiltinAdapters", "GPT2Adapter", "GPTNeoXAdapter", "Gemma3TextAdapter",
           "GenericAdapter", "LlamaAdapter", "plugin"]
