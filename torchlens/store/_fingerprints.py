"""Model fingerprints: which model a recipe or saved trace was made for.

A fingerprint is the model's class, ``config.model_type`` and its parameter names and
shapes (with a hash of them); applying a recipe to a model whose fingerprint differs
raises FingerprintMismatchError naming the differences.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from ..errors import FingerprintMismatchError
from ._load_checks import fail

__all__ = [
    "check_fingerprint_dict", "check_model_fingerprint", "fingerprint", "fingerprint_mismatch", "fingerprint_of",
]


def fingerprint(model: torch.nn.Module) -> dict[str, Any]:
    """What identifies a model for a recipe: class, ``config.model_type``, parameter names and shapes."""
    cls = type(model)
    params = [[name, list(p.shape)] for name, p in model.named_parameters()]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "model_type": None if model_type is None else str(model_type),
        "params_sha256": _params_hash(params),
        "params": params,
    }


def _params_hash(params: list) -> str:
    return hashlib.sha256(json.dumps(params, separators=(",", ":")).encode()).hexdigest()


def fingerprint_of(trace: Any) -> dict[str, Any] | None:
    model = getattr(trace, "model", None)
    if isinstance(model, torch.nn.Module):
        return fingerprint(model)
    return getattr(trace, "fingerprint", None)


def check_fingerprint_dict(fp: Any) -> dict[str, Any] | None:
    """Validate a stored fingerprint (its hash must match its parameter list)."""
    if fp is None:
        return None
    if not isinstance(fp, dict) or set(fp) != {"class", "model_type", "params_sha256", "params"}:
        raise fail("the model fingerprint is malformed")
    params = fp["params"]
    if not isinstance(fp["class"], str) or not isinstance(fp["model_type"], (str, type(None))) or not (
        isinstance(params, list) and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], list)
            and all(type(d) is int and d >= 0 for d in p[1]) for p in params)
    ):
        raise fail("the model fingerprint is malformed")
    if _params_hash(params) != fp["params_sha256"]:
        raise fail("the model fingerprint's hash does not match its parameter list")
    return fp


def fingerprint_mismatch(saved: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Human-readable differences between two fingerprints (empty when they agree)."""
    out = []
    for key, what in (("class", "model class"), ("model_type", "config.model_type")):
        if saved[key] != actual[key]:
            out.append(f"{what}: recipe {saved[key]!r}, model {actual[key]!r}")
    if saved["params_sha256"] != actual["params_sha256"]:
        a = {n: tuple(s) for n, s in saved["params"]}
        b = {n: tuple(s) for n, s in actual["params"]}
        missing = [n for n in a if n not in b]
        extra = [n for n in b if n not in a]
        shaped = [f"{n} {list(a[n])} vs {list(b[n])}" for n in a if n in b and a[n] != b[n]]
        for label, items in (("missing from the model", missing), ("not in the recipe", extra),
                             ("different shape", shaped)):
            if items:
                out.append(f"{len(items)} parameter(s) {label}: {items[:5]}" + (" ..." if len(items) > 5 else ""))
        if not (missing or extra or shaped):
            out.append("parameters are in a different order")
    return out


def check_model_fingerprint(saved: dict[str, Any] | None, actual: dict[str, Any] | None) -> None:
    if saved is None or actual is None:
        return
    problems = fingerprint_mismatch(saved, actual)
    if problems:
        raise FingerprintMismatchError(
            "the recipe was saved for a different model: " + "; ".join(problems), mismatches=problems
        )
