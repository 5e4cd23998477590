"""Attaching feature dictionaries to sites for one capture: ``tl.trace(model, x, features={site: sae})``.

Nothing is added to the model: each dictionary becomes a capture-time *splice* at its site's module
output (see ``torchlens.capture._splice``). Its encode and decode run inside the site's module call
with the recorder on, so their ops are ordinary ops of the trace, and four of them are named:

* ``<site>.features``: the feature activations ``f = encode(x)`` (``[..., d_sae]``), editable;
* ``<site>.recon``: ``decode(f)``, the reconstruction from the (possibly edited) features;
* ``<site>.recon_clean``: ``decode(encode(x))`` of the current input, recorded without being computed a
  second time (one op whose value is the reconstruction already made);
* ``<site>.error``: ``x - recon_clean``, the reconstruction error (read it; to change what flows on,
  edit the site itself or the features).

The site's output becomes ``x + (recon - recon_clean)`` (``x`` detached, as SAELens computes the error
term without gradients, so a backward reaches the features): with nothing edited ``recon - recon_clean`` is
exactly zero, so the output is ``x`` bit for bit and the model's output is its own. An edit of the
features changes ``recon`` only; an edit upstream changes ``x``, and both reconstructions follow it.
With ``use_error_term=False`` the site's output is ``recon`` itself (the dictionary's reconstruction
replaces the activation, SAELens's ``use_error_term=False``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..arch.resolve import bind
from ..capture._splice import SUB_SITE, sub_site_label
from ..core.selectors import Label, ModuleOutput, Selector, as_selector
from ..core.steps import Step
from ..errors import FeatureSiteError, InvalidArgumentError
from .wrap import FeatureDictionary, as_dictionary

__all__ = ["FeatureAttachment", "FeatureSplice", "attach", "dictionaries", "feature_steps", "sub_site_reads"]


class FeatureAttachment:
    """A dictionary with how to splice it: ``tl.features.attach(sae, use_error_term=False)``."""

    def __init__(self, dictionary: FeatureDictionary, use_error_term: bool) -> None:
        self.dictionary = dictionary
        self.use_error_term = use_error_term

    def __repr__(self) -> str:
        return f"attach({self.dictionary!r}, use_error_term={self.use_error_term})"


def attach(sae: Any, *, use_error_term: bool = True) -> FeatureAttachment:
    """How to splice ``sae`` at a site, as a value of ``features=``: ``features={site: attach(sae, ...)}``.

    Args:
        sae: a feature dictionary (anything :func:`~torchlens.features.as_dictionary` takes).
        use_error_term: True (the default, also for a bare ``{site: sae}``) keeps the reconstruction error,
            so the model computes exactly what it computes alone; False makes the site's value the
            reconstruction ``decode(encode(x))`` (SAELens's ``use_error_term=False``).

    Raises:
        NotAFeatureDictionaryError: ``sae`` has no encode / decode.
    """
    return FeatureAttachment(as_dictionary(sae), bool(use_error_term))


class _CleanRecon:
    """The function of a ``<site>.recon_clean`` op: ``decode(encode(x))``, as replay re-runs it."""

    __name__ = "sae_recon_clean"

    def __init__(self, dictionary: FeatureDictionary) -> None:
        self.dictionary = dictionary

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.dictionary.decode(self.dictionary.encode(x))


class FeatureSplice:
    """The capture-time edit that splices a feature dictionary into one site (made by ``feature_steps``).

    Called as a plain edit (``edit(x, ctx=...)``: a path that does not record ops) it returns what the
    site's output becomes; under the recorder ``splice`` also records and names the sub-sites.
    """

    name = "features"
    may_change_nothing = True  # with the error term kept, the site's value is unchanged: that is the point

    def __init__(self, dictionary: FeatureDictionary, site: str, use_error_term: bool = True,
                 address: str = "") -> None:
        self.dictionary = dictionary
        self.site = site
        self.address = address  # the real module address the site names
        self.use_error_term = bool(use_error_term)
        self._clean = _CleanRecon(dictionary)
        # The sub-site values of each pass when applied as a plain edit (module hooks, no op recorded):
        # {(pass, part): value}, what ``tl.extract`` reads on that path.
        self.seen: dict[tuple[int, str], torch.Tensor] = {}

    def _check(self, value: Any, where: str) -> None:
        self.dictionary.check_input(value, site=where)

    def splice(self, x: Any, tools: Any) -> torch.Tensor:
        self._check(x, tools.call.key if tools.call.pass_index != 1 else tools.call.address)
        d = self.dictionary
        raw_f = d.encode(x)
        f = tools.name(raw_f, "features")  # a capture-time edit of <site>.features gives another tensor
        raw_recon = d.decode(f)
        recon = tools.name(raw_recon, "recon")
        if not self.use_error_term:
            tools.name(x - recon, "error")
            return recon
        # The clean reconstruction is the one just made, unless the features or the reconstruction were
        # edited during this capture: then it is made again from the encoder's output (not an op).
        value = raw_recon if f is raw_f else tools.unrecorded(d.decode, raw_f)
        clean = tools.opaque(self._clean, (x,), value, "recon_clean")
        tools.name(x - clean, "error")
        # x's own gradient path is cut, as SAELens's error term is computed without gradients: a backward
        # reaches the features (d out / d features = the decoder) and, through the encoder, the site's input.
        return x.detach() + (recon - clean)

    def __call__(self, x: Any, *, ctx: Any = None) -> torch.Tensor:
        self._check(x, self.site)
        f = self.dictionary.encode(x)
        recon = self.dictionary.decode(f)
        n = getattr(ctx, "pass_index", None) or 1
        self.seen.update({(n, "features"): f, (n, "recon"): recon, (n, "recon_clean"): recon,
                          (n, "error"): x - recon})
        return recon if not self.use_error_term else x + (recon - recon)

    def portable_refusal(self) -> tuple[str, str]:
        """Why a portable recipe cannot hold this splice, and what to do instead (``NotPortableError``)."""
        return (
            f"the feature dictionary attached at {self.site!r} ({self.dictionary!r}) is part of this trace's "
            "capture, and a portable recipe stores no dictionary weights (nor the code that encodes and decodes)",
            "Keep the SAE's weights apart (a SAELens folder: sae.save_model(folder), read back by "
            "tl.features.load_sae(folder)) and attach it again to redo the edits: tl.trace(model, x, "
            "features={site: sae}).fork().do(...), the feature edits being named helpers. level='pickle' "
            "stores the dictionary too when it pickles (a module-level nn.Module class; a SAELens SAE does "
            "not: it holds local functions); loading it then needs allow_pickle=True.",
        )

    def describe_choice(self, trace: Any, op: Any, seen: str) -> str | None:
        """Why replay stops at guard op ``op`` when it is this dictionary's own selection (a TopK encoder's
        ``topk``: an ancestor of ``<site>.features`` in the same module call), else None."""
        if op.module != self.address:
            return None
        label = sub_site_label(self.address, op.module_pass, "features")
        ops = trace.ops
        target = next((o for o in ops[op.index + 1:] if o.label == label), None)
        todo, seen_ops = ([] if target is None else [target.index]), set()
        while todo:  # the encoder's ops: from the features op back, down to op's index
            i = todo.pop()
            if i == op.index:
                return (f"the edit changes which features the TopK feature dictionary at {self.site!r} selects "
                        f"({seen}); a TopK selection depends on every feature of a position and is not "
                        "replayable row by row from the recorded one")
            if i in seen_ops or i < op.index:
                continue
            seen_ops.add(i)
            todo.extend(r.index for r in ops[i].parent_refs or ())
        return None

    def sub_site_value(self, part: str, pass_index: int = 1) -> torch.Tensor:
        """A sub-site's value from the last plain application (``__call__``) of this splice.

        Raises:
            FeatureSiteError: the site did not run that pass.
        """
        found = self.seen.get((pass_index, part))
        if found is None:
            raise FeatureSiteError(f"{self.site!r} did not run pass {pass_index} in this forward", site=self.site)
        return found

    def __repr__(self) -> str:
        return f"FeatureSplice({self.site!r}, {self.dictionary!r}, use_error_term={self.use_error_term})"


def feature_steps(model: nn.Module, features: Any) -> list[Step]:
    """Capture-time steps splicing each dictionary of ``features`` (``{site: dictionary}``) into ``model``.

    Args:
        model: the model the sites name (canonical names such as ``blocks.6`` are resolved here).
        features: ``{site: dictionary}`` (or ``{site: attach(dictionary, use_error_term=False)}``); a site is
            a module output (a module address or canonical name).

    Returns:
        One step per site, for ``CaptureRequest.intervene``.

    Raises:
        InvalidArgumentError: ``features`` is not a mapping.
        NotAFeatureDictionaryError: a value has no encode / decode.
        FeatureSiteError: a site is not one module's output (an op, several modules, a pass index).
    """
    if not isinstance(features, Mapping) or not features:
        raise InvalidArgumentError(
            f"features= takes a dict {{site: sae}}, got {type(features).__name__}",
            remedy="Pass features={'blocks.6': sae} (several sites: one entry per site).")
    steps = []
    for site, obj in features.items():
        use_error_term = True
        if isinstance(obj, FeatureAttachment):
            obj, use_error_term = obj.dictionary, obj.use_error_term
        dictionary = as_dictionary(obj)
        bound = bind(model, as_selector(site) if not isinstance(site, Selector) else site)
        paths = bound.module_paths()
        if not paths or len(paths) != 1 or ":" in paths[0]:
            raise FeatureSiteError(
                f"features= attaches to one module's output; {site!r} is "
                + (f"{bound.describe()}" if paths is None else f"{paths}"),
                site=str(site))
        splice = FeatureSplice(dictionary, str(site), use_error_term, address=paths[0])
        steps.append(Step(ModuleOutput(paths[0]), splice))
    return steps


def sub_site_reads(selectors: dict[str, Selector], steps: list[Step]) -> dict[str, tuple[FeatureSplice, str, int]]:
    """Which of ``selectors`` (bound) read a sub-site of a dictionary spliced by ``steps``:
    ``{key: (splice, part, pass)}``, so a module-hooks capture can serve them from the splice itself."""
    by_address = {s.edit.address: s.edit for s in steps if isinstance(s.edit, FeatureSplice)}
    found = {}
    for key, sel in selectors.items():
        match = SUB_SITE.match(sel.label) if isinstance(sel, Label) else None
        if match is not None and match["site"] in by_address:
            found[key] = (by_address[match["site"]], match["part"], int(match["pass"] or 1))
    return found


def dictionaries(trace: Any) -> dict[str, FeatureDictionary]:
    """The feature dictionaries a trace (or fork) was captured with, by the real module address of their site.

    Args:
        trace: a trace captured with ``features=`` (a fork gives its parent's).

    Returns:
        ``{address: dictionary}``, e.g. ``{"transformer.h.6": FeatureDictionary(...)}`` for
        ``features={"blocks.6": sae}``; empty when none was attached.
    """
    found = {}
    for step in getattr(trace, "steps", None) or ():
        if isinstance(step.edit, FeatureSplice):
            found[step.edit.address] = step.edit.dictionary
    return found
