"""Policies written as text: ``"dynaquant:tolerance=0.01,bins=64|32"``.

A *spec* is a registered policy name, optionally followed by ``:`` and comma-separated
``option=value`` pairs, where an option is one of the policy's constructor arguments.
Values are read as int, float, ``true``/``false``/``none`` or text; ``a|b|c`` is a tuple (``16|``
a tuple of one), and a single value given for a tuple option becomes a tuple of one.
This is what the CLI's ``--policy`` and ``CheckpointManager(path, policy="...")`` accept,
so that a policy's knobs can live in a command line or a config file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from .base import Policy

__all__ = ["parse_policy_spec"]


def _parse_value(text: str) -> Any:
    if "|" in text:
        return tuple(_parse_value(part.strip()) for part in text.split("|") if part.strip())
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def _options(factory: Callable[..., Policy]) -> dict[str, dataclasses.Field]:
    """The options a spec may set: the constructor's fields, except the name and those
    that take a function (no text stands for one)."""
    if not dataclasses.is_dataclass(factory):
        return {}
    return {
        field.name: field
        for field in dataclasses.fields(factory)
        if field.init and field.name != "name" and "Callable" not in str(field.type)
    }


def parse_policy_spec(spec: str, factories: Mapping[str, Callable[..., Policy]]) -> Policy:
    """The policy ``spec`` describes, built by its factory in ``factories`` (name -> class).

    Raises:
        ValueError: an unknown policy or option, an option without ``=``, or a value the
            policy refuses (its own message).
    """
    name, _, options = spec.partition(":")
    name = name.strip()
    if name not in factories:
        raise ValueError(f"unknown policy {name!r}; use one of {', '.join(factories)} (options after ':')")
    known = _options(factories[name])
    kwargs: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in options.split(","))):
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"policy option {item!r} in {spec!r} is not option=value")
        if key not in known:
            choices = ", ".join(known) or "none"
            raise ValueError(f"policy {name!r} has no option {key!r} (options: {choices})")
        if key in kwargs:
            raise ValueError(f"policy option {key!r} is given twice in {spec!r}")
        value = _parse_value(text.strip())
        if isinstance(known[key].default, tuple) and not isinstance(value, tuple):
            value = (value,)
        kwargs[key] = value
    try:
        return factories[name](**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"policy {spec!r}: {exc}") from None
