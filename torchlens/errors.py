"""Every error TorchLens raises, rooted at one class so callers can catch them all.

Each leaf says, in the user's terms, what went wrong; each instance carries a
``remedy`` (what to do instead) and the structured fields that located the problem
(``site``, ``op_label``, ``source`` ...), so tools can act on them without parsing text.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AmbiguousSiteError", "AmbiguousTokenError", "CaptureError", "CaptureMemoryError", "DatasetError",
    "DatasetFormatError", "DatasetRowError", "DrawingScaledDown", "EditDtypeError", "EditError", "EditHadNoEffect",
    "EditHadNoEffectError", "EditNotAppliedError", "EditShapeError", "EmptyGenerationError", "EmptySelectionError",
    "FacetReadOnlyError", "FeatureDictionaryFormatError", "FeatureDtypeError", "FeatureError", "FeatureIndexError",
    "FeatureSiteError", "FeatureWidthError", "FingerprintMismatchError", "FormatVersionError", "FunctionsNotResolved",
    "FusedKernelError", "GenerationError", "GenerationStrategyError", "GraphvizNotFoundError", "GuardChangedError",
    "InvalidArgumentError", "JobMismatchError", "LayoutInferenceError", "LegacyArgumentError", "NoGenerateError",
    "NotAFeatureDictionaryError", "NotPortableError",
    "OptionalDependencyError", "OutOfOrderError", "PaddingNotSupportedError", "PickleNotAllowedError", "PluginError",
    "PositionNotInStepError", "RandomForwardError", "RandomOpsWarning", "RecipeError", "RecipeExistsError",
    "RecipeFormatError", "RecipeHelperError", "ReplayError", "ReplayFallbackError", "ReplayFellBack",
    "ReplayNotExactError",
    "ShardWriteError", "ShimUnsupportedError", "SiteError", "SiteNotFoundError", "SiteNotInStepError",
    "StepEditShapeError", "StepNotFoundError", "StepSiteOutsideGenerationError", "StopCapture", "TextError",
    "TokenNotFoundError", "TokenizerRequiredError",
    "TooManySitesError", "TorchLensError", "TraceStoreWriteError", "UnknownHelperError", "UnsafePathError",
    "UnsupportedModelError", "ValueNotSavedError", "all_error_classes",
]


class TorchLensError(Exception):
    """Root of every TorchLens error; its message always ends with what to do."""

    remedy: str = ""

    def __init__(self, message: str, *, remedy: str | None = None, **fields: Any) -> None:
        self.message = message
        self.remedy = remedy if remedy is not None else type(self).remedy
        self.fields = fields
        for key, value in fields.items():
            setattr(self, key, value)
        text = message if not self.remedy else f"{message}\n  remedy: {self.remedy}"
        super().__init__(text)

    def __reduce__(self):  # keep errors picklable across processes/threads
        return (_rebuild, (type(self), self.message, self.remedy, self.fields))


def _rebuild(cls, message, remedy, fields):
    return cls(message, remedy=remedy, **fields)


# -- choosing where to look --------------------------------------------------------------


class SiteError(TorchLensError, LookupError):
    """A site or selector could not be resolved against a model or trace."""


class EmptySelectionError(SiteError):
    """A selector matched no op or module of the trace (the nearest names are listed)."""

    remedy = "Check the selector against trace.modules and trace.layers; combine selectors with | to widen."


class SiteNotFoundError(EmptySelectionError):
    """No module, op label or selector match has the name you gave."""

    remedy = "Use one of the nearest valid names listed, or list them with trace.modules / trace.layers."


class LayoutInferenceError(SiteNotFoundError):
    """A canonical site no adapter declares could not be inferred: candidates tie, or its structural check failed."""

    remedy = ("Name the real module path instead (trace.modules lists them), or declare the layout: an adapter whose "
              "view() returns torchlens.arch.Layout(blocks=..., attn=..., mlp=..., resid_mid=...).view(model, name) "
              "(docs/plugins.md); tl.arch.describe(model) shows what was inferred.")


class AmbiguousSiteError(SiteError):
    """The name matches several passes of a module; say which one (``address:N``)."""

    remedy = "Add the pass number to the address ('address:N', the passes are listed), or use tl.module(address) " \
             "with find_sites to get every pass."


class TooManySitesError(SiteError):
    """A selector matched more sites than ``max_fanout`` allows."""

    remedy = "Narrow the selector (combine with &), or raise max_fanout."


class ValueNotSavedError(SiteError):
    """The op was recorded but its output was not kept (``save=`` excluded it)."""

    remedy = "Capture again with save= a selector that includes this op (or save=None to keep all)."


# -- capture -------------------------------------------------------------------------------


class CaptureError(TorchLensError):
    """Capturing a forward failed for a reason of TorchLens's, not the model's."""


class CaptureMemoryError(CaptureError, MemoryError):
    """The values an in-memory capture would hold do not fit in the memory available."""

    remedy = ("Keep fewer values with save= (a selector: only they are held, the rest is freed as the forward "
              "runs), or write every value to disk with store=path; max_bytes= sets the limit.")


class TraceStoreWriteError(CaptureError, OSError):
    """Writing a disk-backed trace (``store=``) failed: the disk is full or an I/O error happened."""

    remedy = ("Free space or pass store= a directory on a disk with room (an every-op trace needs about "
              "trace-size bytes: see docs/big-models.md), or write fewer values with save= next to store=.")


class UnsupportedModelError(CaptureError):
    """The object cannot be captured eagerly (not an nn.Module, compiled, scripted...)."""

    remedy = "Pass the original eager nn.Module (for torch.compile: model._orig_mod)."


class InvalidArgumentError(TorchLensError, TypeError):
    """An argument of a TorchLens call has the wrong type or value."""

    remedy = "See the call's docstring for the accepted types."


class LegacyArgumentError(InvalidArgumentError):
    """A keyword spelled as in the older TorchLens package (``log_forward_pass``), which this one names differently."""

    remedy = "Use the spelling given in the message (docs/concepts.md, 'Inputs', lists them all)."


class StopCapture(Exception):
    """Raised inside a capture to end the forward early; swallowed by the capture itself."""


# -- edits -------------------------------------------------------------------------------


class EditError(TorchLensError):
    """An edit could not be applied as asked."""


class EditShapeError(EditError, ValueError):
    """An edit's value does not broadcast to the activation it replaces."""

    remedy = "Give a tensor whose shape broadcasts to the activation's shape, or use a function edit."


class EditDtypeError(EditError, TypeError):
    """A function edit returned a value of another dtype than the activation it replaces."""

    remedy = "End the edit with .to(activation.dtype) (compute in another dtype inside it if you need to)."


class EditNotAppliedError(EditError):
    """An edit's site never fired during the forward, so nothing was edited."""

    remedy = "Pick a site from the ones that fired (listed), or a pass that exists."


class EditHadNoEffectError(EditError):
    """An edit changed no element of the activation, and the trace is strict (``strict=True``)."""

    remedy = "Check the edit against the activation (a mean over a dimension of size 1 is the value itself); " \
             "an edit that may legitimately change nothing sets may_change_nothing = True."


class EditHadNoEffect(UserWarning):
    """Warning: an edit changed no element of the activation (an error under ``tl.trace(..., strict=True)``)."""


class UnknownHelperError(EditError, LookupError):
    """No edit helper is registered under that name."""

    remedy = "Register it with tl.register_helper, or install the plugin that provides it."


# -- replay ------------------------------------------------------------------------------


class ReplayError(TorchLensError):
    """Re-executing recorded ops failed."""


class ReplayNotExactError(ReplayError):
    """The recorded graph cannot reproduce this edit exactly, so replay refuses."""

    remedy = "Re-execute the real forward instead: fork.do(site, edit, model=model, inputs=x)."


class GuardChangedError(ReplayNotExactError):
    """An edit changed a value the forward branched on (a guard), so the recorded path no longer holds."""

    remedy = ("Let replay fall back to re-executing the real forward: fork.do(site, edit, replay='fallback') "
              "(needs the trace's model), or re-execute explicitly: fork.do(site, edit, model=model, inputs=x).")


class RandomForwardError(ReplayNotExactError):
    """The forward drew random numbers (dropout left on by training mode, ``torch.rand``...), so a
    workflow comparing runs of it would compare random draws."""

    remedy = ("Call model.eval() before capturing (training mode leaves dropout on), then capture again; a "
              "random op of the model's own (noise, sampling) needs a fixed seed or its removal.")


class RandomOpsWarning(UserWarning):
    """Warning: the captured forward drew random numbers (dropout left on by training mode, ...);
    replay and the patching workflows refuse those ops."""


class ReplayFallbackError(TorchLensError):
    """A replay strategy declared a fallback to a slower path while ``TORCHLENS_STRICT_FALLBACKS``
    is set (tests proving a fast path ran; ``.strategy`` and ``.reason`` say which and why)."""

    remedy = "Unset TORCHLENS_STRICT_FALLBACKS to let replay fall back (the fork's edits[-1].replay.decisions say why)."


class ReplayFellBack(UserWarning):
    """A fork's edit changed a guard, so the real forward was re-executed instead of replaying."""


class FusedKernelError(TorchLensError):
    """The edit targets an intermediate that exists only inside a fused kernel."""

    remedy = "Re-capture with attn_implementation='eager', where scores and softmax are ordinary ops."


class FacetReadOnlyError(FusedKernelError):
    """Facets are reconstructions; writing to them would not change the model."""

    remedy = "Use torchlens.mechinterp.patch_head(..., what='pattern') to edit a head's pattern."


# -- persistence -------------------------------------------------------------------------


class RecipeError(TorchLensError):
    """A saved recipe or trace could not be written, read or applied."""


class RecipeFormatError(RecipeError, ValueError):
    """A .tlspec/ or saved trace on disk is malformed, hostile or from a newer format."""

    remedy = ("Save it again with this TorchLens version (trace.save(path) for a trace, fork.save_intervention(path) "
              "for a recipe); never hand-edit the manifest.")


class FingerprintMismatchError(RecipeError):
    """The recipe was saved for a different model than the one it is applied to."""

    remedy = "Apply it to the model it was saved for, or pass check_fingerprint=False to override."


class NotPortableError(RecipeError):
    """The recipe holds code (a plain function), which the portable level refuses to pickle."""

    remedy = "Use a named helper (tl.zero_ablate(), tl.scale(k) ...) or save with level='pickle'."


class FormatVersionError(RecipeFormatError):
    """The save was written by a newer TorchLens in a format this version cannot read."""

    remedy = "Upgrade TorchLens to the version named, or save it again with this one."


class UnsafePathError(RecipeFormatError):
    """The manifest names a file outside its directory (a path, '..', an absolute path, a symlink)."""

    remedy = "Do not load this directory: a save only ever names plain files inside itself."


class RecipeHelperError(RecipeFormatError, UnknownHelperError):
    """The recipe names an edit helper that is not installed, or parameters it does not take."""

    remedy = "Install the plugin that provides the helper (tl.register_helper), then load again."


class PickleNotAllowedError(RecipeError):
    """The recipe holds pickled code; loading it would run that code, so it needs consent."""

    remedy = "Only if you trust its author: tl.load_intervention(path, allow_pickle=True)."


class FunctionsNotResolved(UserWarning):
    """Warning: a loaded trace names functions not on the allow-list; those ops are readable, not replayable."""


class RecipeExistsError(RecipeError, FileExistsError):
    """Saving would replace an existing path."""

    remedy = "Pass overwrite=True to replace an earlier TorchLens save, or choose another path."


# -- pictures, tables and other optional extras ---------------------------------------------


class OptionalDependencyError(TorchLensError, ImportError):
    """The feature needs an optional package that is not installed (matplotlib, pandas, graphviz ...)."""

    remedy = "pip install 'torchlens[viz]' (pictures, plots, progress bars, tables)."


class GraphvizNotFoundError(OptionalDependencyError):
    """Graphviz's ``dot`` program is not installed, so a graph cannot be laid out; ``to_dot()`` still works."""

    remedy = ("Install Graphviz: apt-get install graphviz (Debian/Ubuntu), brew install graphviz (macOS) or "
              "conda install graphviz; or render trace.to_dot() with any Graphviz viewer.")


class DrawingScaledDown(UserWarning):
    """Warning: Graphviz shrank a bitmap picture (PNG) to fit its size limit, so its labels may be unreadable."""

    remedy = ("Write an SVG or PDF, which are not scaled (trace.draw('graph.svg')), or draw fewer nodes: a "
              "smaller depth= (depth='auto' keeps the picture readable) or focus= on one region.")


# -- activation datasets (tl.cache_activations / tl.map_dataset) -------------------------


class DatasetError(TorchLensError):
    """Streaming a dataset through a model to disk failed; finished shards are kept."""

    remedy = "Fix the cause named, then rerun the same call: it resumes after the last finished shard."


class DatasetRowError(DatasetError, ValueError):
    """A dataset row is not token ids or text (or cannot be fed to this model as it is)."""

    remedy = "Give rows of token ids (lists of ints, 1-D integer tensors, {'input_ids': ...}) or text with tokenizer=."


class JobMismatchError(DatasetError):
    """The output directory holds a different job (another model, other arguments, other data)."""

    remedy = "Rerun with exactly the arguments of the first run, choose a new out= directory, or pass overwrite=True."


class ShardWriteError(DatasetError, OSError):
    """Writing a shard failed (disk full, I/O error); the directory is left resumable."""

    remedy = "Free space or fix the disk, then rerun the same call: it resumes after the last finished shard."


class DatasetFormatError(DatasetError, ValueError):
    """An activation dataset on disk is malformed, incomplete or fails its checksums."""

    remedy = "Rerun the job that wrote it (it resumes and rewrites what is missing), or delete the directory."


# -- text in (strings as inputs, token strings as positions) -------------------------------


class TextError(TorchLensError, ValueError):
    """Text given as an input could not be tokenized, or a token string could not be found in a prompt."""

    remedy = "See docs/concepts.md, 'Text in'."


class TokenizerRequiredError(TextError, DatasetRowError):
    """Text was given (an input, a dataset row, or token strings asked of a trace), but no tokenizer is known."""

    remedy = ("Pass tokenizer=tok (a Hugging Face tokenizer: AutoTokenizer.from_pretrained(...)), or set it once on "
              "the model: model.tokenizer = tok; or give token ids.")


class PaddingNotSupportedError(TextError, DatasetRowError):
    """Texts or rows of different lengths need padding, but the model's forward takes no attention_mask."""

    remedy = "Give one text (or rows of equal length, or batch_size=1), or a model whose forward takes attention_mask."


class TokenNotFoundError(TextError, LookupError):
    """A position was given as a token string that is not a token of the prompt (its tokens are listed)."""

    remedy = "Give one of the listed token strings exactly (leading spaces count), or the position as an int."


class AmbiguousTokenError(TextError, LookupError):
    """A position was given as a token string that occurs several times in the prompt (every position is named)."""

    remedy = "Give the position as an int: one of the positions named."


# -- plugins and shims -------------------------------------------------------------------


class PluginError(TorchLensError):
    """A plugin failed to load or raised inside a hook."""

    remedy = "Fix or uninstall the plugin named; TorchLens keeps working without it."


class OutOfOrderError(TorchLensError):
    """A value was requested after the forward had already gone past it (nnsight semantics)."""

    remedy = "Access modules in the order the forward runs them, or use separate traces/invokes."


class ShimUnsupportedError(TorchLensError, NotImplementedError):
    """The shim cannot honour this call of the original library."""

    remedy = "TorchLens runs the local eager forward; see the migration guide for the equivalent."


# -- generation (tl.generate) ------------------------------------------------------------


class GenerationError(TorchLensError):
    """Running or reading a generation (``tl.generate``) failed; the model is left as it was."""

    remedy = "See the generation guide (docs/generation.md) for what tl.generate runs, reads and refuses."


class NoGenerateError(GenerationError, UnsupportedModelError):
    """The model has no ``generate`` method and no decoding loop was given."""

    remedy = ("Pass a Hugging Face model (a GenerationMixin), or your own decoding loop: "
              "tl.generate(model, inputs, loop=fn), where fn(model, inputs) calls the model once per step "
              "and returns the token ids.")


class GenerationStrategyError(GenerationError, NotImplementedError):
    """The decoding strategy (beam search, assisted, contrastive ...) is not one ``tl.generate`` runs."""

    remedy = ("Use greedy decoding (do_sample=False) or sampling (do_sample=True, with seed=), one beam; "
              "or write the strategy as a decoding loop: tl.generate(model, inputs, loop=fn).")


class EmptyGenerationError(GenerationError, ValueError):
    """The generation would choose no token (``max_new_tokens=0``), or the loop never called the model."""

    remedy = "Ask for at least one new token (max_new_tokens >= 1); a loop must call model(...) at least once."


class StepNotFoundError(GenerationError, SiteError, IndexError):
    """A step index beyond the steps the generation ran (their number is given)."""

    remedy = "Use a step between 0 and the number of steps minus one (len(gen.steps)); step 0 reads the prompt."


class PositionNotInStepError(GenerationError, SiteError, IndexError):
    """The step did not compute that position (with a KV cache a step computes only its new tokens)."""

    remedy = "Read the position at the step that computed it (gen.step_of(position)), or read it without a step."


class SiteNotInStepError(GenerationError, SiteNotFoundError, EditNotAppliedError):
    """The site did not run at that step of the generation (e.g. it runs in the prompt pass only)."""

    remedy = ("Address only the steps where it runs: tl.at_step(site, steps) (the message lists them; "
              "gen.steps_running(site) too).")


class StepSiteOutsideGenerationError(GenerationError, SiteError):
    """A site with a step (``tl.at_step``) was given to something that records one forward, not a generation."""

    remedy = "Pass it to tl.generate(..., intervene=...) or to a generation trace (gen.read), or drop tl.at_step."


class StepEditShapeError(GenerationError, EditShapeError):
    """An edit fits some steps (the prompt pass) but not another (a one-token step): the step and shapes are named."""

    remedy = ("Give an edit that broadcasts over the sequence axis (a vector of the hidden size, or shape "
              "(1, 1, d)), a function edit, or restrict it to the steps it fits: tl.at_step(site, 0).")


# -- feature dictionaries (tl.features: SAEs and transcoders at a site) --------------------


class FeatureError(TorchLensError):
    """A feature dictionary (an SAE or transcoder) could not be read, attached or edited; the model is unchanged."""

    remedy = "See the features guide (docs/features.md) for what a feature dictionary needs and how it attaches."


class NotAFeatureDictionaryError(FeatureError, TypeError):
    """The object given as a feature dictionary has no ``encode(x)`` and ``decode(f)`` methods."""

    remedy = ("Pass an nn.Module with encode(x) -> f and decode(f) -> x_hat, a SAELens SAE, or a dictionary "
              "loaded with tl.features.load_sae(path).")


class FeatureWidthError(FeatureError, ValueError):
    """The dictionary's input width differs from the width of the site it is attached to (both are named)."""

    remedy = "Attach the dictionary to a site of its input width (d_in), or use the dictionary trained for this site."


class FeatureDtypeError(FeatureError, TypeError):
    """The dictionary's dtype or device differs from the site's (the message says which, and both values)."""

    remedy = "Move the dictionary to the site's dtype and device first: sae.to(dtype=..., device=...)."


class FeatureIndexError(FeatureError, IndexError):
    """A feature index outside 0 .. d_sae - 1 (the dictionary's width is named)."""

    remedy = "Use feature indices between 0 and d_sae - 1 (tl.features.as_dictionary(sae).d_sae)."


class FeatureSiteError(FeatureError, SiteError):
    """A dictionary was attached to a site whose value is not one tensor (e.g. a tuple), or to no such site."""

    remedy = ("Attach it to a site whose output is one tensor: a block's residual (blocks.6 on a canonical model, "
              "or the submodule producing the tensor you mean); trace.modules lists the names.")


class FeatureDictionaryFormatError(FeatureError, ValueError):
    """A saved dictionary's folder lacks cfg.json / sae_weights.safetensors, or names an architecture not read here."""

    remedy = ("Point load_sae at a folder in SAELens's layout (cfg.json + sae_weights.safetensors) of a standard, "
              "jumprelu or topk SAE; load others with SAELens and pass the SAE object itself.")


def all_error_classes() -> list[type[TorchLensError]]:
    """Every public error class, for the generated errors page and its drift test."""
    found: list[type[TorchLensError]] = []
    stack: list[type] = [TorchLensError]
    while stack:
        cls = stack.pop(0)
        if cls not in found:
            found.append(cls)
        stack.extend(cls.__subclasses__())
    return [c for c in found if c.__module__ == __name__]
