"""``TransformersModel`` / ``LanguageModel``: a transformers model and its tokenizer, traced.

Wraps an already-loaded transformers model (or a local checkpoint directory) so
a trace can take text: prompts are tokenized and, across invokes, padded into
one batch (left for causal LMs). ``generate`` runs the model's own generation
loop as the traced call (read the ids from ``tracer.result``, step through
forwards with ``tracer.iter``); ``pipe`` runs a transformers pipeline around the
same model. The shim never downloads: a model id that is not on disk raises
`ModelDownloadError`, and tensor-parallel loading raises its own refusal.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import transformers

from .. import processing
from ..envoy import Envoy, traceable
from ..errors import (
    AttentionImplementationError,
    MaskTokenMissingError,
    ModelDownloadError,
    NNsightDeprecationWarning,
    TaskInferenceError,
    TensorParallelUnsupportedError,
)
from .huggingface import HuggingFaceModel

__all__ = ["Generator", "GeneratorEnvoy", "LanguageModel", "TransformersModel"]

_PREPROCESSORS = ("tokenizer", "image_processor", "feature_extractor", "processor")
_ARCH_TASK = {
    "ForCausalLM": "text-generation",
    "LMHeadModel": "text-generation",
    "ForConditionalGeneration": "text-generation",
    "ForMaskedLM": "fill-mask",
    "ForSequenceClassification": "text-classification",
    "ForTokenClassification": "token-classification",
}
_TASK_AUTO = {
    "text-generation": "AutoModelForCausalLM",
    "fill-mask": "AutoModelForMaskedLM",
    "text-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "feature-extraction": "AutoModel",
}
_TP_KWARGS = ("tp_plan", "distributed_config", "tp_size", "device_mesh")


class _Passthrough(torch.nn.Module):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if len(args) == 1 else args


class Generator(_Passthrough):
    """Generated ids pass through here (``model.generator``); per-step tokens through ``.streamer``."""

    class Streamer(_Passthrough):
        """Receives tokens as they are decoded (transformers' streamer protocol)."""

        def put(self, value: Any) -> Any:
            return self(value)

        def end(self) -> None:
            pass

    def __init__(self) -> None:
        super().__init__()
        self.streamer = Generator.Streamer()


_GENERATOR_OUTPUT_DEPRECATED = (
    "model.generator.output is deprecated; use tracer.result instead "
    "(model.generator.streamer.output still gives per-step tokens)."
)


class GeneratorEnvoy(Envoy):
    """The generator's envoy: its ``.output`` is deprecated in favour of ``tracer.result``."""

    @property
    def output(self) -> Any:
        warnings.warn(_GENERATOR_OUTPUT_DEPRECATED, NNsightDeprecationWarning, stacklevel=2)
        return Envoy.output.__get__(self)

    @output.setter
    def output(self, value: Any) -> None:
        warnings.warn(_GENERATOR_OUTPUT_DEPRECATED, NNsightDeprecationWarning, stacklevel=2)
        Envoy.output.__set__(self, value)


def _is_text(data: Any) -> bool:
    return isinstance(data, str) or (
        isinstance(data, (list, tuple)) and bool(data) and all(isinstance(item, str) for item in data)
    )


def _infer_task(module: torch.nn.Module) -> str:
    if getattr(module, "can_generate", lambda: False)():
        return "text-generation"
    names = getattr(getattr(module, "config", None), "architectures", None) or [type(module).__name__]
    for name in names:
        for suffix, task in _ARCH_TASK.items():
            if name.endswith(suffix):
                return task
    raise TaskInferenceError(
        f"could not infer a pipeline task for a pre-loaded {type(module).__name__}; pass task=... "
        "explicitly (e.g. TransformersModel(model, task='feature-extraction'))"
    )


def _local_config(repo_id: str, revision: str | None) -> Any:
    """The checkpoint's config from a local directory or the local cache, never from the network."""
    try:
        return transformers.AutoConfig.from_pretrained(repo_id, revision=revision, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ModelDownloadError(
            f"{repo_id!r} is neither a local checkpoint directory nor in the local cache, and the shim "
            "does not download models",
            repo_id=repo_id,
        ) from error


def _config_task(config: Any) -> str:
    names = getattr(config, "architectures", None) or []
    return next(
        (t for name in names for suffix, t in _ARCH_TASK.items() if name.endswith(suffix)),
        "feature-extraction",
    )


_LOAD_KWARGS = ("dtype", "torch_dtype", "attn_implementation", "trust_remote_code")


class TransformersModel(HuggingFaceModel):
    """A transformers model traced with text inputs; see the module docstring.

    Built from a hub id or a local directory, the model is first built on the ``meta``
    device (``_load_meta``: the architecture and the tokenizer, no weights) and loads its
    weights (``_load``) on ``dispatch()``, ``dispatch=True`` or the first trace, as in
    nnsight; a subclass overrides those two steps to build the model its own way. A
    module given directly is used as it is.

    Attributes:
        tokenizer: the tokenizer prompts go through (its pad token and padding side
            are set as nnsight sets them: EOS padding, left side for causal LMs).
        task: the pipeline task (inferred from the model when not given).
        generator: the module generated ids pass through (``.streamer`` per step).
        dispatched: whether the real weights are loaded.
    """

    def __init__(
        self,
        repo_id: Any,
        *args: Any,
        task: str | None = None,
        tokenizer: Any = None,
        processor: Any = None,
        image_processor: Any = None,
        feature_extractor: Any = None,
        revision: str | None = None,
        dispatch: bool = False,
        **kwargs: Any,
    ) -> None:
        for key in _TP_KWARGS:
            if kwargs.get(key) is not None:
                raise TensorParallelUnsupportedError(
                    f"{key}= asks for a tensor-parallel load; the shim runs one local eager forward",
                    option=key,
                )
        # set before loading: a subclass's `_load_meta` reads (and may fill) them
        for name, value in (
            ("tokenizer", tokenizer),
            ("processor", processor),
            ("image_processor", image_processor),
            ("feature_extractor", feature_extractor),
            ("task", task),
            ("pipeline", None),
            ("peft", kwargs.pop("peft", None)),
            ("args", args),
        ):
            object.__setattr__(self, name, value)
        super().__init__(repo_id, *args, revision=revision, dispatch=dispatch, **kwargs)
        if isinstance(repo_id, torch.nn.Module):
            object.__setattr__(self, "repo_id", getattr(repo_id, "name_or_path", None))
            if self.task is None:
                object.__setattr__(self, "task", _infer_task(repo_id))

    def _built(self) -> None:
        generator = GeneratorEnvoy(Generator(), path=f"{self.path}.generator", tree=self._tree, parent=self)
        object.__setattr__(self, "generator", generator)
        self._children.append(generator)
        self._standalone.append(generator)
        self._configure_tokenizer()

    # -- loading (a subclass may override both) ----------------------------------------------
    def _auto_class(self, config: Any) -> Any:
        if self.task is None:
            object.__setattr__(self, "task", _config_task(config))
        return getattr(transformers, _TASK_AUTO.get(self.task, "AutoModel"))

    def _load_meta(self, repo_id: str, *args: Any, **kwargs: Any) -> torch.nn.Module:
        """The architecture from the local config, on the meta device, and the local tokenizer."""
        config = _local_config(repo_id, self.revision)
        load = {k: v for k, v in kwargs.items() if k in _LOAD_KWARGS}
        module = self._auto_class(config).from_config(config, **load)
        if self.tokenizer is None:
            self._load_tokenizer(repo_id)
        return module.eval()

    def _load(self, repo_id: str, *args: Any, **kwargs: Any) -> torch.nn.Module:
        """The checkpoint's weights from a local directory or the local cache."""
        config = _local_config(repo_id, self.revision)
        load = {k: v for k, v in kwargs.items() if k in _LOAD_KWARGS}
        module = self._auto_class(config).from_pretrained(
            repo_id, revision=self.revision, local_files_only=True, **load
        )
        if self.tokenizer is None:
            self._load_tokenizer(repo_id)
        return module.eval()

    def _load_tokenizer(self, repo_id: str) -> None:
        """The checkpoint's tokenizer, when it has one on disk (a model may have none)."""
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                repo_id, revision=self.revision, local_files_only=True
            )
        except (OSError, ValueError):
            tokenizer = None
        object.__setattr__(self, "tokenizer", tokenizer)

    # -- attention implementation -------------------------------------------------------------
    @property
    def attn_implementation(self) -> str | None:
        """The attention implementation transformers resolved for this model (``"sdpa"``, ``"eager"``…)."""
        return getattr(getattr(self._module, "config", None), "_attn_implementation", None)

    def set_attn_implementation(self, name: str) -> None:
        """Switch the model's attention implementation (``"eager"`` returns attention weights).

        Args:
            name: an implementation transformers knows (``"eager"``, ``"sdpa"``, …); kept for
                the weights a later dispatch loads.

        Raises:
            AttentionImplementationError: transformers does not know or cannot use ``name`` for
                this model (the model keeps its implementation).
        """
        if name == self.attn_implementation:
            return
        try:
            self._module.set_attn_implementation(name)
        except (ValueError, ImportError) as error:
            raise AttentionImplementationError(
                f"can't switch {type(self._module).__name__} to attn_implementation={name!r}: {error}"
            ) from error
        self._load_kwargs["attn_implementation"] = name

    def _remoteable_get_env(self) -> dict:
        """nnsight's name: the settings a run depends on (the attention implementation)."""
        return {"attn_implementation": self.attn_implementation}

    def _remoteable_set_env(self, env: dict | None) -> None:
        """nnsight's name: apply `_remoteable_get_env` settings (a missing key changes nothing)."""
        requested = (env or {}).get("attn_implementation")
        if requested is not None:
            self.set_attn_implementation(requested)

    def _is_encoder_decoder(self) -> bool:
        return bool(getattr(getattr(self._module, "config", None), "is_encoder_decoder", False))

    def _is_causal(self) -> bool:
        can_generate = getattr(self._module, "can_generate", lambda: False)()
        return bool(can_generate) and not self._is_encoder_decoder()

    def _configure_tokenizer(self) -> None:
        tokenizer = self.tokenizer
        if tokenizer is None or not hasattr(tokenizer, "pad_token"):
            return  # not a transformers tokenizer (a subclass's own): nothing to set
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        if self._is_causal():
            tokenizer.padding_side = "left"
        elif self._is_encoder_decoder():
            tokenizer.padding_side = "right"

    # -- running -----------------------------------------------------------------------
    def trace(self, *inputs: Any, fn: Any = None, **kwargs: Any) -> Any:
        return super().trace(*inputs, fn=fn if fn is not None else self._call, **kwargs)

    def scan(self, *inputs: Any, fn: Any = None, **kwargs: Any) -> Any:
        return super().scan(*inputs, fn=fn if fn is not None else self._call, **kwargs)

    @traceable
    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """Generate through the model and return the token ids (``tracer.result`` in a trace)."""
        config = kwargs.get("generation_config") or getattr(self._module, "generation_config", None)
        num_beams = kwargs.get("num_beams") or getattr(config, "num_beams", None) or 1
        if num_beams == 1:
            kwargs.setdefault("streamer", self.generator.streamer._module)
        output = self._module.generate(*inputs, **kwargs)
        return self.generator(output, hook=True)

    @traceable
    def pipe(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the task's transformers pipeline around this model; returns what it postprocesses to."""
        if self.pipeline is None:
            # Lazy: transformers.pipelines is heavy (it loads every task's code); only pipe() needs it.
            from transformers import pipeline

            object.__setattr__(
                self, "pipeline", pipeline(self.task, model=self._module, tokenizer=self.tokenizer)
            )
        return self.pipeline(*inputs, **kwargs)

    def _call(self, *inputs: Any, **kwargs: Any) -> Any:
        preprocessor = self.processor or self.tokenizer or self.image_processor or self.feature_extractor
        if preprocessor is not None and inputs and isinstance(inputs[0], (str, list)):
            prepared = preprocessor(*inputs, return_tensors="pt").to(next(self._module.parameters()).device)
            return self._module(**prepared, **kwargs)
        return self._module(*inputs, **kwargs)

    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        return processing.batch_size(inputs, kwargs)

    def _batch(self, invokes: list, fn: Any) -> tuple:
        if getattr(fn, "__name__", None) == "pipe":
            return processing.batch_pipe(invokes)
        args, kwargs = processing.batch_forward(self, invokes)
        if self.task == "fill-mask" and all(_is_text(inputs[0] if inputs else None) for inputs, _ in invokes):
            self._check_mask(kwargs.get("input_ids"))  # the fill-mask pipeline checks text input so
        return args, kwargs

    def _check_mask(self, ids: Any) -> None:
        """Every row of a fill-mask batch holds the mask token, as the fill-mask pipeline requires."""
        mask = getattr(self.tokenizer, "mask_token_id", None)
        if mask is None or not isinstance(ids, torch.Tensor):
            return
        missing = [row for row in range(ids.shape[0]) if not bool((ids[row] == mask).any())]
        if missing:
            raise MaskTokenMissingError(
                f"fill-mask input without the mask token {self.tokenizer.mask_token!r} in batch rows {missing}"
            )


class LanguageModel(TransformersModel):
    """Deprecated name: a `TransformersModel` pinned to text generation (warns on construction)."""

    def __init__(self, *args: Any, tokenizer_kwargs: dict | None = None, **kwargs: Any) -> None:
        if type(self) is LanguageModel:
            warnings.warn(
                "LanguageModel is deprecated; use TransformersModel(repo_id, task='text-generation') instead.",
                NNsightDeprecationWarning,
                stacklevel=2,
            )
        kwargs.setdefault("task", "text-generation")
        super().__init__(*args, **kwargs)
        for key, value in (tokenizer_kwargs or {}).items():
            setattr(self.tokenizer, key, value)


