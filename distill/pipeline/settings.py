"""Typed, frozen settings for the pipeline's public classes, given as one object or as
keyword arguments (the seed README's, and the classes' other keywords), or both."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, TypeVar

S = TypeVar("S")


def merge(cls: type[S], config: S | None, options: dict[str, Any], owner: str) -> S:
    """``config`` (or ``cls()``'s defaults) with the keyword arguments ``options`` applied
    (a value of None means "not given"); a keyword that is no field of ``cls`` is
    refused by name, with the list of fields."""
    if config is not None and not isinstance(config, cls):
        raise TypeError(f"{owner}(config=...) takes a {cls.__name__}, not {type(config).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"{owner} got unexpected keyword argument(s) {unknown}; its settings are the "
                        f"fields of {cls.__name__}: {sorted(known)}")
    given = {name: value for name, value in options.items() if value is not None}
    return replace(config, **given) if config is not None else cls(**given)
