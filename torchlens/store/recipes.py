"""Saved interventions: ``fork.save_intervention(path)`` writes a ``.tlspec/`` directory,
``tl.load_intervention(path)`` reads it back as a :class:`Recipe`.

A recipe is data, not code: each step is a site (a selector rebuilt from a small JSON
form) and an edit (a named helper and its parameters, a tensor, or a number); tensors
go to one safetensors file. ``level="portable"`` never pickles, so loading a recipe from
a stranger cannot run code; ``level="pickle"`` may pickle plain functions, says so in
the manifest, and loading it needs ``allow_pickle=True``. A recipe remembers which model
it was made for (class, ``config.model_type``, parameter names and shapes) and refuses a
different one unless told ``check_fingerprint=False``.

The parts a recipe is made of live in their own modules (their public names stay
importable from here): :mod:`torchlens.selector_codec` (sites as JSON),
:mod:`torchlens.fingerprints` (which model) and :mod:`torchlens.patch_sources` (what a
``patch_from`` source provided); the directory itself is :mod:`torchlens.ondisk`.
"""

from __future__ import annotations

import numbers
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..core.actions import provide_methods
from ..core.records import EDIT
from ..core.repr_html import repr_html
from ..core.selectors import Label, Selector
from ..core.steps import CAPTURE, PHASES, REPLAY, Step
from ..core.trace import Trace
from ..edit.helpers import Helper, helper_class
from ..errors import (
    InvalidArgumentError,
    NotPortableError,
    PickleNotAllowedError,
    RecipeHelperError,
    TorchLensError,
    UnknownHelperError,
)
from ._fingerprints import (
    check_fingerprint_dict,
    check_model_fingerprint,
    fingerprint,
    fingerprint_of,
)
from ._fingerprints import fingerprint_mismatch as fingerprint_mismatch  # re-exported: it lived here
from ._load_checks import fail, guarded, loading
from ._ondisk import (
    FIRST_VERSION,
    SavedDir,
    check_path_arg,
    installed_version,
    read_file_entry,
    read_manifest,
    read_tensors,
    write_dir,
)
from ._patch_sources import StoredSource, is_source, record_source
from ._selector_codec import selector_from_dict, selector_to_dict
from ._value_codec import Decoder, TensorTable, encode

LEVELS = ("portable", "pickle")
PICKLE_FILE = "code.pkl"
_RECIPE_KEYS = {"format", "kind", "format_version", "torchlens_version", "level", "executes_code_on_load",
                "fingerprint", "steps", "tensors", "files"}

# -- edits and steps <-> JSON ------------------------------------------------------------------


def encode_edit(edit: Any, records: list[tuple[Any, Any]] | None, site: str, table: TensorTable, stem: str,
                pickles: list[Any] | None) -> dict[str, Any]:
    """The JSON form of one edit; tensors go to ``table``; plain functions only into ``pickles``.

    Raises:
        NotPortableError: the edit holds code and ``pickles`` is None (portable level).
    """
    put = lambda t, name=stem: {"tensor": table.put(t, name)}  # noqa: E731
    if isinstance(edit, Helper):
        try:
            known = helper_class(edit.name)
        except UnknownHelperError:
            known = None
        if known is not type(edit):
            raise NotPortableError(
                f"helper {edit.name!r} ({type(edit).__qualname__}) is not registered under that name, so a "
                "loader could not rebuild it",
                remedy="Register the class with tl.register_helper (or a torchlens_helpers plugin).",
            )
        params: dict[str, Any] = {}
        for key, value in edit.params().items():
            if isinstance(value, Selector):
                params[key] = {"selector": selector_to_dict(value)}
            elif is_source(value):
                if not isinstance(value, StoredSource):
                    value = record_source(edit, key, records or [], site)
                params[key] = {"source": {
                    "values": [[k, encode(v, lambda t, k=k, key=key: put(t, f"{stem}.{key}/{k}"))]
                               for k, v in sorted(value.values.items())],
                    "passes": sorted([a, n] for a, n in value.passes.items()),
                }}
            else:
                params[key] = encode(value, lambda t, key=key: put(t, f"{stem}.{key}"))
        return {"kind": "helper", "helper": edit.name, "params": params}
    if isinstance(edit, torch.Tensor):
        return {"kind": "tensor", "tensor": table.put(edit, f"{stem}.value")}
    if isinstance(edit, numbers.Number):
        value = edit
        if type(edit) not in (bool, int, float, complex):  # numpy scalars and friends
            value = int(edit) if isinstance(edit, numbers.Integral) else (
                float(edit) if isinstance(edit, numbers.Real) else complex(edit))
        return {"kind": "number", "value": encode(value, put)}
    refusal = getattr(edit, "portable_refusal", None)
    if pickles is None and callable(refusal):  # an edit that says why it cannot go in a portable recipe
        message, remedy = refusal()
        raise NotPortableError(message, remedy=remedy)
    if pickles is None:
        raise NotPortableError(
            f"the edit {getattr(edit, '__qualname__', type(edit).__name__)} is a plain Python function; the "
            "portable level never stores code",
            remedy="Use a named helper (tl.zero_ablate(), tl.scale(k), tl.add(v) ...), or save with "
                   "level='pickle' (loading it then runs code and needs allow_pickle=True).",
        )
    pickles.append(edit)
    return {"kind": "pickle", "index": len(pickles) - 1}


def encode_step(phase: str, site: Any, edit: Any, trace: Any, table: TensorTable, stem: str,
                pickles: list[Any] | None) -> dict[str, Any]:
    sel = site if isinstance(site, Selector) else Label(site)
    records = None
    if trace is not None and isinstance(edit, Helper) and any(is_source(v) for v in edit.params().values()):
        try:
            matched = sel.match(trace)
        except TorchLensError:
            matched = []
        records = []
        for r in matched:
            if getattr(r, "flags", 0) & EDIT:
                continue
            try:
                records.append((r, trace.read(r)))
            except TorchLensError:  # a value the capture did not keep
                continue
    return {"phase": phase, "site": selector_to_dict(sel),
            "edit": encode_edit(edit, records, sel.describe(), table, stem, pickles)}


def encode_steps(items: list[tuple[str, Any, Any]], trace: Any, table: TensorTable,
                 prefix: str) -> tuple[list[Any], list[str]]:
    """Steps for a saved trace: one that cannot be stored portably becomes None and is listed."""
    out: list[Any] = []
    unsaved: list[str] = []
    for k, (phase, site, edit) in enumerate(items):
        try:
            out.append(encode_step(phase, site, edit, trace, table, f"{prefix}.step{k}", None))
        except NotPortableError as exc:
            out.append(None)
            where = site.describe() if isinstance(site, Selector) else repr(site)
            unsaved.append(f"{phase} step {k} at {where}: {exc.message}")
    return out, unsaved


def decode_edit(obj: Any, dec: Decoder, pickled: list[Any] | None, where: str) -> Any:
    if not isinstance(obj, dict) or "kind" not in obj:
        raise fail(f"{where}: an edit must be an object with a 'kind'")
    kind = obj["kind"]
    if kind == "helper":
        if set(obj) != {"kind", "helper", "params"} or not isinstance(obj["helper"], str) or not isinstance(
                obj["params"], dict):
            raise fail(f"{where}: a helper edit has exactly 'helper' (a name) and 'params' (an object)")
        name = obj["helper"][:200]
        try:
            cls = helper_class(name)
        except UnknownHelperError as exc:
            raise RecipeHelperError(f"{where}: {exc.message}", helper=name) from None
        params = {k: _decode_param(v, dec, f"{where} {name}.{k}") for k, v in obj["params"].items()}
        try:
            return cls(**params)
        except (TypeError, ValueError, TorchLensError) as exc:
            raise RecipeHelperError(f"{where}: helper {name!r} rejected its saved parameters: {exc}",
                                    helper=name) from None
    if kind == "tensor" and set(obj) == {"kind", "tensor"}:
        return dec.tensor(obj["tensor"], where)
    if kind == "number" and set(obj) == {"kind", "value"}:
        value = dec.value(obj["value"], where)
        if type(value) not in (bool, int, float, complex):
            raise fail(f"{where}: a number edit holds {type(value).__name__}")
        return value
    if kind == "pickle" and set(obj) == {"kind", "index"}:
        if pickled is None:
            raise fail(f"{where}: a pickled edit in a save that carries no pickled code (a trace never does, a "
                       "recipe only at level='pickle')")
        index = obj["index"]
        if type(index) is not int or not 0 <= index < len(pickled):
            raise fail(f"{where}: pickled edit index {index!r:.20} is out of range")
        return pickled[index]
    raise fail(f"{where}: unknown or malformed edit kind {str(kind)[:40]!r}")


def _decode_param(v: Any, dec: Decoder, where: str) -> Any:
    if isinstance(v, dict) and len(v) == 1 and "selector" in v:
        return selector_from_dict(v["selector"])
    if isinstance(v, dict) and len(v) == 1 and "source" in v:
        src = v["source"]
        if not (isinstance(src, dict) and set(src) == {"values", "passes"}):
            raise fail(f"{where}: a saved source has exactly 'values' and 'passes'")
        values, passes = {}, {}
        for pair in src["values"] if isinstance(src["values"], list) else [None]:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                raise fail(f"{where}: saved source values are malformed")
            values[pair[0]] = dec.value(pair[1], where)
        for pair in src["passes"] if isinstance(src["passes"], list) else [None]:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and type(pair[1]) is int
                    and 0 <= pair[1] <= 1 << 20):
                raise fail(f"{where}: saved source passes are malformed")
            passes[pair[0]] = pair[1]
        return StoredSource(values, passes)
    return dec.value(v, where)


def decode_step(obj: Any, dec: Decoder, pickled: list[Any] | None, where: str) -> Step:
    if not isinstance(obj, dict) or set(obj) != {"phase", "site", "edit"}:
        raise fail(f"{where} must have exactly 'phase', 'site' and 'edit'")
    if obj["phase"] not in PHASES:
        raise fail(f"{where}: phase must be 'capture' or 'replay', got {str(obj['phase'])[:20]!r}")
    return Step(selector_from_dict(obj["site"]), decode_edit(obj["edit"], dec, pickled, where), obj["phase"])


def decode_steps(steps: Any, unsaved: Any, dec: Decoder, phase: str) -> tuple[list[Any], list[str]]:
    """Steps of a saved trace: capture-time steps, or a fork's replay steps (None where unsaved)."""
    if not isinstance(steps, list) or not isinstance(unsaved, list) or not all(isinstance(u, str) for u in unsaved):
        raise fail(f"the trace's {phase} steps are malformed")
    out: list[Any] = []
    for k, obj in enumerate(steps):
        if obj is None:
            out.append(None)
            continue
        step = decode_step(obj, dec, None, f"{phase} step {k}")
        out.append(Step(step.site, step.edit, CAPTURE if phase == "capture" else REPLAY))
    return out, [u[:1000] for u in unsaved]


# -- the recipe --------------------------------------------------------------------------------


class Recipe:
    """An ordered list of (site, edit) steps and the model they were made for.

    ``recipe.apply(trace)`` replays them on a fork of ``trace``; ``tl.trace(model, x,
    intervene=recipe)`` applies them during capture. Both check the model fingerprint.
    """

    def __init__(self, steps: list[Step], fingerprint: dict[str, Any] | None, *, level: str = "portable",
                 torchlens_version: str | None = None, format_version: int = FIRST_VERSION,
                 path: Path | None = None, check_fingerprint: bool = True) -> None:
        self.steps = steps
        self.fingerprint = fingerprint
        self.level = level
        self.torchlens_version = torchlens_version
        self.format_version = format_version
        self.path = path
        self.check_fingerprint = check_fingerprint

    def check(self, model_or_trace: Any) -> None:
        """Raise FingerprintMismatchError if the recipe was made for a different model."""
        actual = fingerprint(model_or_trace) if isinstance(model_or_trace, torch.nn.Module) else \
            fingerprint_of(model_or_trace)
        check_model_fingerprint(self.fingerprint, actual)

    def apply(self, trace: Any, *, name: str | None = None, check_fingerprint: bool | None = None) -> Any:
        """Replay every step on a new fork of ``trace`` and return the fork.

        Raises:
            FingerprintMismatchError: ``trace`` comes from a different model (override with
                ``check_fingerprint=False``).
            ReplayNotExactError / SiteNotFoundError: as ``fork.do`` would.
        """
        if not hasattr(trace, "fork"):
            raise InvalidArgumentError(f"apply() takes a Trace, got {type(trace).__name__}",
                                       remedy="Capture first: recipe.apply(tl.trace(model, x)).")
        if self.check_fingerprint if check_fingerprint is None else check_fingerprint:
            self.check(trace)
        fork = trace.fork(name or "recipe")
        for step in self.steps:
            fork.do(step.site, step.edit)
        return fork

    def as_whens(self, model: torch.nn.Module | None = None, *, check_fingerprint: bool | None = None) -> list[Step]:
        """Fresh capture-time steps for a capture (checked against ``model`` when given)."""
        if model is not None and (self.check_fingerprint if check_fingerprint is None else check_fingerprint):
            self.check(model)
        return [step.for_capture() for step in self.steps]

    def save(self, path: Any, level: str = "portable", *, overwrite: bool = False) -> Path:
        """Write this recipe again (e.g. a loaded one, to a new place)."""
        return save_intervention(self, path, level=level, overwrite=overwrite)

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __repr__(self) -> str:
        model = (self.fingerprint or {}).get("class", "any model")
        steps = ", ".join(f"{s.site.describe()}: {s.edit!r}" for s in self.steps[:4])
        more = " ..." if len(self.steps) > 4 else ""
        return f"<Recipe {self.level}, {len(self.steps)} step(s) for {model}: {steps}{more}>"

    def _repr_html_(self) -> str:
        return repr_html(self)  # rendered by torchlens.analysis.notebook


# -- save / load ----------------------------------------------------------------------------------


def save_intervention(obj: Any, path: Any, level: str = "portable", overwrite: bool = False) -> Path:
    """Write the edits of a trace / fork (or a Recipe) as a ``.tlspec/`` directory.

    Capture-time edits (``trace.steps``) come first, then a fork's replay steps.

    Args:
        level: ``"portable"`` (never pickles; plain-function edits refuse) or ``"pickle"``
            (plain functions are pickled; loading needs ``allow_pickle=True``).
        overwrite: replace an earlier TorchLens save at ``path``.

    Returns:
        the directory written.

    Raises:
        NotPortableError: an edit holds code at the portable level, or cannot be stored.
        RecipeExistsError: ``path`` exists and ``overwrite`` is false.
    """
    check_path_arg(path)
    if level not in LEVELS:
        raise InvalidArgumentError(f"level must be one of {LEVELS}, got {level!r}")
    if isinstance(obj, Recipe):
        items = [(s.phase, s.site, s.edit) for s in obj.steps]
        fp, trace = obj.fingerprint, None
    else:
        lost = [*obj.unsaved_steps]
        parent = getattr(obj, "parent", None)
        if parent is not None:
            lost += [s for s in parent.unsaved_steps if s not in lost]
        if lost:
            raise NotPortableError(f"this trace was loaded without {len(lost)} edit(s) that could not be saved: "
                                   f"{lost[:3]}", remedy="Save the recipe from the original trace or fork.")
        items = [(s.phase, s.site, s.edit) for s in obj.all_steps()]
        fp, trace = fingerprint_of(obj), obj
    table = TensorTable()
    pickles: list[Any] | None = [] if level == "pickle" else None
    steps = [encode_step(phase, site, edit, trace, table, f"step{k}", pickles)
             for k, (phase, site, edit) in enumerate(items)]
    extra = None
    if pickles is not None:
        try:
            extra = {"pickle": (PICKLE_FILE, pickle.dumps(pickles))}
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise NotPortableError(
                f"an edit cannot be pickled: {exc}",
                remedy="Define the edit function at module level (lambdas and local functions do not pickle), "
                       "or use a named helper.",
            ) from None
    manifest = {
        "kind": "recipe",
        "torchlens_version": installed_version(),
        "level": level,
        "executes_code_on_load": level == "pickle",
        "fingerprint": fp,
        "steps": steps,
    }
    return write_dir(path, manifest, table.tensors, extra, overwrite=overwrite)


def load_intervention(path: Any, *, allow_pickle: bool = False, check_fingerprint: bool = True) -> Recipe:
    """Read a ``.tlspec/`` directory back as a :class:`Recipe`.

    A portable recipe is only parsed, never executed. A ``level="pickle"`` recipe runs
    code when loaded and is refused unless ``allow_pickle=True``.

    Args:
        path: the ``.tlspec/`` directory.
        allow_pickle: consent to run the pickled code of a ``level="pickle"`` recipe.
        check_fingerprint: the default for ``apply`` / ``as_whens``: refuse a different model.

    Returns:
        the Recipe.

    Raises:
        RecipeFormatError: the directory is malformed, hostile or newer (the subclasses
            FormatVersionError, UnsafePathError and RecipeHelperError say which).
        PickleNotAllowedError: the recipe holds pickled code and ``allow_pickle`` is false.
    """
    check_path_arg(path)
    with loading("recipe"):
        with SavedDir(path) as d:
            m = read_manifest(d, "recipe")
            unknown = set(m) - _RECIPE_KEYS
            if unknown:
                raise fail(f"the manifest has unknown fields {sorted(unknown)[:5]}")
            level = m.get("level")
            if level not in LEVELS or m.get("executes_code_on_load") is not (level == "pickle"):
                raise fail(f"level must be one of {LEVELS} and executes_code_on_load must say whether it pickles")
            files = m.get("files")
            if level == "portable" and isinstance(files, dict) and "pickle" in files:
                raise fail("a portable recipe must not carry pickled code")
            if level == "pickle" and not allow_pickle:
                raise PickleNotAllowedError(
                    f"{d.path} was saved with level='pickle': loading it runs code from the file", path=str(d.path))
            tensors = read_tensors(d, m)
            raw = read_file_entry(d, m, "pickle", required=False)
        pickled = None
        if raw is not None:
            obj = pickle.loads(raw)  # noqa: S301 - only with allow_pickle=True, which the caller chose
            pickled = obj if isinstance(obj, list) else None
        return guarded(_build_recipe, m, tensors, pickled, d.path, check_fingerprint)


def _build_recipe(m: dict[str, Any], tensors: dict[str, torch.Tensor], pickled: list[Any] | None, path: Path,
                  check_fingerprint: bool) -> Recipe:
    fp = check_fingerprint_dict(m.get("fingerprint"))
    dec = Decoder(tensors)
    steps_json = m.get("steps")
    if not isinstance(steps_json, list):
        raise fail("manifest 'steps' must be a list")
    steps = [decode_step(s, dec, pickled, f"step {k}") for k, s in enumerate(steps_json)]
    dec.check_all_used()
    version = m.get("torchlens_version")
    return Recipe(steps, fp, level=m["level"], torchlens_version=version if isinstance(version, str) else None,
                  format_version=m["format_version"], path=path, check_fingerprint=check_fingerprint)


@provide_methods(Trace)
class SaveInterventionMethod:
    """``Trace.save_intervention``, provided by ``store/`` (see ``torchlens.core.actions``)."""

    def save_intervention(self: Trace, path: Any, level: str = "portable", *, overwrite: bool = False) -> Path:
        """Write this trace's edits (capture-time steps and, on a fork, its recipe) as ``.tlspec/``
        (see :func:`save_intervention`)."""
        return save_intervention(self, path, level=level, overwrite=overwrite)


__all__ = ["Recipe", "SaveInterventionMethod", "StoredSource", "fingerprint", "load_intervention", "save_intervention",
           "selector_from_dict", "selector_to_dict"]
