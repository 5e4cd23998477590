"""The conformance checks behind :func:`check_model`, each a row of a :class:`ConformanceReport`."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..api import trace as capture
from ..arch import CheckedResidualAdd, arch, check_layout
from ..core.selectors import module as module_site
from ..core.tree import first_tensor, tensor_leaves
from ..edit.validate import validate
from ..errors import InvalidArgumentError, TorchLensError

__all__ = ["CheckResult", "ConformanceReport", "check_model"]

_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")
_KINDS = ("capture", "model", "validate", "adapter", "sites", "replay", "facets")


@dataclass(frozen=True)
class CheckResult:
    """One check: its ``name`` (``"replay blocks.0.mlp"``), whether it ``passed``, and ``detail``
    (why it failed, or what it compared)."""

    name: str
    passed: bool
    detail: str = ""

    def __str__(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'} {self.name}" + (f": {self.detail}" if self.detail else "")


@dataclass
class ConformanceReport:
    """What :func:`check_model` found: one :class:`CheckResult` per check, in the order run.

    ``ok`` is True when every check passed; ``failures`` lists the others; ``summary()`` (also
    ``str``) prints every row; ``assert_ok()`` raises ``AssertionError`` with the summary, for tests.
    """

    model: str
    adapter: str | None
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.passed]

    def names(self) -> list[str]:
        return [r.name for r in self.results]

    def summary(self) -> str:
        head = (f"conformance of {self.model} (adapter {self.adapter or '-'}): "
                f"{'OK' if self.ok else f'{len(self.failures)} of {len(self.results)} checks FAILED'}")
        return "\n".join([head, *(f"  {r}" for r in self.results)])

    __str__ = summary

    def assert_ok(self) -> ConformanceReport:
        """Raise ``AssertionError`` listing every check when one failed; else return the report."""
        if not self.ok:
            raise AssertionError(self.summary())
        return self

    def _add(self, name: str, passed: bool, detail: str = "") -> None:
        self.results.append(CheckResult(name, bool(passed), detail))


def check_model(model: nn.Module, inputs: Any, *, kwargs: dict | None = None, adapter: str | None = None,
                edit_sites: Iterable[str] | None = None, atol: float = 1e-5,
                checks: Iterable[str] = _KINDS) -> ConformanceReport:
    """Run the conformance checks on one model and return the report.

    Args:
        model: an eager ``nn.Module`` in the mode it is used in (``eval()`` for inference).
        inputs: the forward's positional input (a tensor) or inputs (a tuple).
        kwargs: keyword inputs of the forward.
        adapter: the adapter that must serve ``model`` (``tl.arch(model).adapter``); None: any.
        edit_sites: modules whose output the replay check scales by 0.5 (canonical names or module
            paths); None: ``blocks.0.mlp`` and the last block's ``mlp`` when the model has them.
        atol: largest absolute difference a replay may have from the hooked forward.
        checks: which kinds of checks run, among ``"capture"`` (capture bit-equal to a plain
            forward), ``"model"`` (capture leaves the model unchanged), ``"validate"``
            (``tl.validate`` OK), ``"adapter"``, ``"sites"`` (every declared canonical site is found
            and passes ``torchlens.arch.check_layout``), ``"replay"`` (a replayed edit equals a
            forward hook doing the same edit) and ``"facets"`` (attention facets reproduce the
            kernel's output).

    Returns:
        a ConformanceReport (``.ok``, ``.failures``, ``.summary()``, ``.assert_ok()``).

    Raises:
        InvalidArgumentError: ``model`` is not an ``nn.Module``, or ``checks`` names an unknown kind.
        SiteNotFoundError: an ``edit_sites`` entry names nothing in the model.

    Warnings the capture gives (a random forward) are not re-raised: the failing rows name them.
    """
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"check_model() takes an nn.Module, got {type(model).__name__}",
                                   remedy="Pass the model instance: check_model(model, inputs).")
    wanted = set(checks)
    unknown = sorted(wanted - set(_KINDS))
    if unknown:
        raise InvalidArgumentError(f"check_model(checks=) names unknown kinds {unknown}; kinds: {list(_KINDS)}",
                                   remedy=f"Pick among {list(_KINDS)}.")
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    kwargs = dict(kwargs or {})
    view, why_no_view = _view(model)
    report = ConformanceReport(type(model).__name__, view.adapter if view is not None else None)
    before = _model_state(model)
    with torch.no_grad():
        plain = model(*args, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace = capture(model, *args, **kwargs)
    if "capture" in wanted:
        got, want = tensor_leaves(trace.output), tensor_leaves(plain)
        same = len(got) == len(want) and all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, want))
        noted = "; ".join(str(w.message).splitlines()[0] for w in caught[:2])
        report._add("capture equals a plain forward", same,
                    f"{len(want)} output tensor(s) bit-equal" if same else "the captured output differs from "
                    "model(*inputs)" + (f" ({noted})" if noted else ""))
    if "model" in wanted:
        after = _model_state(model)
        report._add("capture leaves the model unchanged", after == before,
                    "" if after == before else "hooks, a patched forward, the mode or a weight changed")
    if "validate" in wanted:
        result = validate(trace)
        report._add("validate", result.ok, result.summary().splitlines()[0] if result.ok else result.summary())
    if "adapter" in wanted:
        if view is None:
            report._add("adapter serves the model", False, why_no_view)
        elif adapter is not None:
            report._add(f"adapter is {adapter!r}", view.adapter == adapter, f"tl.arch(model).adapter == "
                        f"{view.adapter!r}")
    if "sites" in wanted and view is not None:
        _check_sites(report, trace, view)
    if "replay" in wanted:
        sites = list(edit_sites) if edit_sites is not None else _default_edit_sites(view)
        if not sites:
            report._add("replay", False, "no site to edit: pass edit_sites= (a module path), or serve the model "
                        "with an adapter that declares blocks.L.mlp")
        for site in sites:
            _check_replay(report, model, trace, site, args, kwargs, atol)
    if "facets" in wanted and view is not None:
        _check_facets(report, trace, view, atol)
    return report


def _view(model: nn.Module) -> tuple[Any, str]:
    try:
        return arch(model), ""
    except TorchLensError as exc:
        return None, exc.message


def _model_state(model: nn.Module) -> Any:
    """What a capture could leave behind: hooks, forward slots, modes, and every weight's bytes."""
    modules = tuple((name, tuple(len(getattr(m, t, None) or {}) for t in _HOOK_TABLES), "forward" in m.__dict__,
                     m.training) for name, m in model.named_modules(remove_duplicate=False))
    weights = tuple((name, t.detach().clone()) for name, t in model.state_dict(keep_vars=True).items())
    return _Same(modules, weights)


class _Same:
    """Model state compared by value, tensors bit for bit."""

    def __init__(self, modules: tuple, weights: tuple) -> None:
        self.modules, self.weights = modules, weights

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and self.modules == other.modules and len(self.weights) == len(other.weights) \
            and all(a == c and b.shape == d.shape and torch.equal(b, d) for (a, b), (c, d) in zip(self.weights,
                                                                                               other.weights))

    __hash__ = None  # type: ignore[assignment]


def _check_sites(report: ConformanceReport, trace: Any, view: Any) -> None:
    """Each canonical name the view offers is found in the trace; each structural identity holds."""
    missing = []
    for name in view.names():
        try:
            found = len(trace.find_sites(module_site(name)))
        except TorchLensError as exc:
            if isinstance(view.targets.get(name), CheckedResidualAdd):
                continue  # an inferred resid_mid its own check refused: not offered, not a failure
            missing.append(f"{name}: {exc.message}")
            continue
        if not found:
            missing.append(f"{name}: matches nothing in the trace")
    report._add("declared canonical sites are found", not missing,
                "; ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                if missing else f"{len(view.names())} site(s)")
    for identity, holds, detail in check_layout(trace, view):
        name = identity.split(" ")[0]
        if not holds and isinstance(view.targets.get(name), CheckedResidualAdd):
            # inferred, and its own check refused it: the site is not offered (reading it raises), as designed
            report._add(f"site {identity}", True, f"not offered: {detail}")
        else:
            report._add(f"site {identity}", holds, detail)


def _default_edit_sites(view: Any) -> list[str]:
    if view is None:
        return []
    mlps = view.names("mlp")
    return list(dict.fromkeys([mlps[0], mlps[-1]])) if mlps else []


def _halved(value: Any) -> Any:
    """``value`` with its first tensor scaled by 0.5 (the rest of a tuple output as it is)."""
    if isinstance(value, torch.Tensor):
        return value * 0.5
    if isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):
        return (value[0] * 0.5, *value[1:])
    raise InvalidArgumentError(f"the replay check scales a tensor output; this site returns {type(value).__name__}",
                               remedy="Pass edit_sites= naming modules that return a tensor (or a tuple "
                                      "starting with one).")


def _check_replay(report: ConformanceReport, model: nn.Module, trace: Any, site: str, args: tuple, kwargs: dict,
                  atol: float) -> None:
    """A fork's replayed edit at ``site`` against the same edit done by a forward hook."""
    name = f"replay {site}"
    record = trace.find_sites(site).first().record  # a site that names nothing raises: the caller's mistake
    address = getattr(record, "address", None)
    if address is None:
        report._add(name, False, f"{site!r} is an op, not a module output: name a module to compare with a hook")
        return
    try:
        fork = trace.fork("conformance").do(site, lambda value, ctx: _halved(value), replay="strict")
    except TorchLensError as exc:
        report._add(name, False, f"{type(exc).__name__}: {exc.message}")
        return
    handle = model.get_submodule(address).register_forward_hook(lambda mod, inp, out: _halved(out))
    try:
        with torch.no_grad():
            want = model(*args, **kwargs)
    finally:
        handle.remove()
    got, want_leaves = tensor_leaves(fork.output), tensor_leaves(want)
    if len(got) != len(want_leaves) or any(a.shape != b.shape for a, b in zip(got, want_leaves)):
        report._add(name, False, "the replayed output has other tensors or shapes than the hooked forward")
        return
    err = max(((a.double() - b.double()).abs().max().item() if a.numel() else 0.0)
              for a, b in zip(got, want_leaves)) if got else 0.0
    moved = any(not torch.equal(a, b) for a, b in zip(want_leaves, tensor_leaves(trace.output)))
    passed = err <= atol and moved
    detail = f"max abs error {err:.3g} against a forward hook on {address}"
    if not moved:
        detail = f"scaling {address}'s output by 0.5 did not change the model output: pick another edit site"
    report._add(name, passed, detail)


def _check_facets(report: ConformanceReport, trace: Any, view: Any, atol: float) -> None:
    """Where an attention site has facets, ``pattern @ v`` (kv heads spread to the query heads) must
    give ``head_out``, the kernel's own output."""
    for name in view.names("attn"):
        try:
            facets = trace.find_sites(module_site(name)).first().facets
        except TorchLensError:
            continue  # the sites check reports a site that is not found
        if facets is None or not all(hasattr(facets, a) for a in ("pattern", "v", "head_out")):
            continue
        try:
            pattern, v, head_out = facets.pattern, facets.v, facets.head_out
            heads = [facets.kv_head(h) for h in range(pattern.shape[-3])]
            rebuilt = pattern.double() @ v.double()[..., heads, :, :]
        except (TorchLensError, RuntimeError, IndexError) as exc:
            report._add(f"facets {name}", False, f"reading its facets failed: {exc}")
            continue
        target = first_tensor(head_out)
        ok = target is not None and rebuilt.shape == target.shape
        err = (rebuilt - target.double()).abs().max().item() if ok else float("inf")
        report._add(f"facets {name}", ok and err <= atol, f"pattern @ v vs head_out: max abs error {err:.3g}")
