"""The errors the nnsight shim raises, each a TorchLens error carrying a remedy.

nnsight signals most misuse with plain ``ValueError``/``NotImplementedError``.
Ported code may catch those, so every class here also derives from the builtin
nnsight would have raised; the TorchLens root adds the ``remedy`` and lets a
caller catch everything the shim raises at once. The category of the deprecation
warnings the shim repeats from nnsight lives here too, so every layer can warn.
"""

from __future__ import annotations

from torchlens.errors import OutOfOrderError, ShimUnsupportedError, TorchLensError

__all__ = [
    "NNsightDeprecationWarning",
    "OutOfOrderError",
    "ShimUnsupportedError",
    "NNsightShimError",
    "SaveOutsideTraceError",
    "NotInterleavingError",
    "WithBlockNotFoundError",
    "WithBlockShapeError",
    "InvokeError",
    "CacheOrderError",
    "BarrierError",
    "BatchingNotSupportedError",
    "SkipCoverageError",
    "NoGradientError",
    "IterStepError",
    "TaskInferenceError",
    "SourceNotAvailableError",
    "RemoteUnsupportedError",
    "VLLMUnsupportedError",
    "TensorParallelUnsupportedError",
    "ModelDownloadError",
    "InternalsUnsupportedError",
    "RenameError",
    "MaskTokenMissingError",
    "InputFieldError",
    "AttentionImplementationError",
]


class NNsightDeprecationWarning(FutureWarning):
    """The category of every deprecation the shim repeats from nnsight."""


class NNsightShimError(TorchLensError):
    """Root of the shim's own errors (the shared TorchLens ones are re-exported)."""


class SaveOutsideTraceError(NNsightShimError, ValueError):
    """``.save()`` / ``nnsight.save(x)`` was called with no trace running."""

    remedy = "Call .save() inside the `with model.trace(...):` block, on the value you bind."


class NotInterleavingError(NNsightShimError, ValueError):
    """A served value (``.output``, ``.input``, ``tracer.result`` ...) was read outside a run."""

    remedy = (
        "Read .output/.input only inside a `with model.trace(x):` block (or inside a "
        "`with tracer.invoke(x):` block when trace() has no input)."
    )


class WithBlockNotFoundError(NNsightShimError):
    """No ``with`` statement could be read back at the line the tracer was entered from."""

    remedy = (
        "Write the trace as `with model.trace(...):` in a file, a notebook cell or `python -c` "
        "source; code piped on stdin or built with exec() must register itself in linecache."
    )


class WithBlockShapeError(NNsightShimError, ValueError):
    """The ``with`` body has a shape the shim cannot lift out (same-line body, leading ``try``)."""

    remedy = "Start the body on its own line, and put any statement above a leading `try:`."


class InvokeError(NNsightShimError, ValueError):
    """``tracer.invoke`` was used where no batch can be assembled."""

    remedy = (
        "Give trace() an input, or open at least one `with tracer.invoke(x):` block; never "
        "invoke from inside a running trace body."
    )


class CacheOrderError(NNsightShimError, ValueError):
    """``tracer.cache()`` was declared after the block already asked the model for a value."""

    remedy = "Call tracer.cache(...) first thing in the block, before reading any .output/.input."


class BarrierError(NNsightShimError, ValueError):
    """A barrier was never reached by as many blocks as it was built for."""

    remedy = "Create tracer.barrier(n) with n equal to the number of blocks that call it."


class BatchingNotSupportedError(NNsightShimError, NotImplementedError):
    """Several invokes with data were opened on a model that cannot batch them."""

    remedy = (
        "Wrap a transformers model in TransformersModel (which pads and batches prompts), or "
        "concatenate the inputs yourself and trace them as one tensor."
    )


class SkipCoverageError(NNsightShimError, ValueError):
    """A batched ``.skip()`` did not cover every row of the batch."""

    remedy = "Skip the module in every invoke of the trace, or in none."


class NoGradientError(NNsightShimError, NotImplementedError):
    """``with tensor.backward():`` on a tensor that does not require grad."""

    remedy = "Run the forward with gradients enabled (not under torch.no_grad(), not generate())."


class IterStepError(NNsightShimError, ValueError):
    """``tracer.iter`` was given a negative step or used outside a trace body."""

    remedy = "Use non-negative steps, e.g. `for step in tracer.iter[:3]:`, inside the trace block."


class TaskInferenceError(NNsightShimError, ValueError):
    """No task could be inferred for a pre-loaded transformers model."""

    remedy = "Pass task= explicitly, e.g. TransformersModel(model, task='feature-extraction')."


class RenameError(NNsightShimError, ValueError):
    """A ``rename=`` alias would hide something already reachable under that name."""

    remedy = (
        "Pick an alias the envoy, its module and its children do not already answer to, and give "
        "each alias to one path only."
    )


class InputFieldError(NNsightShimError, ValueError):
    """A model input field does not fit the rows or positions of the token ids beside it."""

    remedy = (
        "Give every per-row field one row per sequence of the ids (or one row, for token_type_ids and "
        "position_ids, to share), per-token fields as wide as the ids, and a pad token to pad rows of "
        "different lengths (model.tokenizer.pad_token)."
    )


class AttentionImplementationError(NNsightShimError, ValueError):
    """The model cannot be switched to the attention implementation asked for."""

    remedy = (
        "Use an implementation transformers supports for this model and machine (\"eager\" always works; "
        "\"sdpa\" for most models; flash attention needs its package and a GPU)."
    )


class MaskTokenMissingError(NNsightShimError, ValueError):
    """A fill-mask model was given text without its mask token."""

    remedy = "Put the tokenizer's mask token (tokenizer.mask_token, e.g. [MASK]) where the word to fill goes."


class SourceNotAvailableError(NNsightShimError, AttributeError):
    """``.source`` cannot resolve the operation asked for."""

    remedy = "print(envoy.source) lists the operation names; pick one of those."


class RemoteUnsupportedError(ShimUnsupportedError):
    """``remote=True`` / NDIF: the shim never ships a trace to a server."""

    remedy = (
        "TorchLens runs the local eager forward: drop remote=True and load a model that fits on "
        "this machine; NDIF keys, status() and login() have no local equivalent."
    )


class VLLMUnsupportedError(ShimUnsupportedError):
    """The vLLM back end is not available through the shim."""

    remedy = (
        "TorchLens runs the local eager forward: load the checkpoint with transformers and wrap "
        "it in TransformersModel(hf_model, tokenizer=tok)."
    )


class TensorParallelUnsupportedError(ShimUnsupportedError):
    """Tensor-parallel loading (``tp_plan=``, ``distributed_config=``) is not available."""

    remedy = (
        "TorchLens runs the local eager forward of one process: load the model unsharded and "
        "wrap it in TransformersModel(hf_model, tokenizer=tok)."
    )


class ModelDownloadError(ShimUnsupportedError):
    """A model id was given that is neither a local directory nor in the local cache."""

    remedy = (
        "The shim never downloads: load the model yourself (transformers "
        "AutoModelForCausalLM.from_pretrained(path) and AutoTokenizer) and pass both, "
        "TransformersModel(hf_model, tokenizer=tok), or pass a local checkpoint directory."
    )


class InternalsUnsupportedError(ShimUnsupportedError):
    """An nnsight internal (``Interleaver``, ``Mediator``, ``Controller``, back ends ...) was used directly."""

    remedy = (
        "The shim reproduces nnsight's public behaviour, not its machinery: use model.trace(...), "
        "tracer.invoke(...), envoys and eproperty; docs/coming-from-nnsight.md lists what is not supported."
    )
