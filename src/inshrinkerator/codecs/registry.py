"""The codec registry: ``codec_id`` -> class, and configs -> codec objects."""

from __future__ import annotations

from typing import Any, TypeVar

from ..errors import FormatError
from .base import Codec

__all__ = ["register_codec", "get_codec", "registered_codecs"]

_REGISTRY: dict[str, type[Codec]] = {}
C = TypeVar("C", bound=type[Codec])


def register_codec(cls: C) -> C:
    """Class decorator: make ``cls`` decodable by its ``codec_id``."""
    existing = _REGISTRY.get(cls.codec_id)
    if existing is not None and existing is not cls:
        raise ValueError(f"codec id {cls.codec_id!r} is already taken by {existing.__name__}")
    _REGISTRY[cls.codec_id] = cls
    return cls


def get_codec(config: Any) -> Codec:
    """Build the codec a JSON config describes; :class:`FormatError` for unknown or bad ones."""
    if not isinstance(config, dict) or not isinstance(config.get("id"), str):
        raise FormatError(f"codec config must be an object with an 'id', got {str(config)[:80]!r}")
    cls = _REGISTRY.get(config["id"])
    if cls is None:
        raise FormatError(
            f"unknown codec {config['id']!r}; the file needs a newer inshrinkerator "
            f"(known codecs: {', '.join(sorted(_REGISTRY))})"
        )
    return cls.from_config(config)


def registered_codecs() -> dict[str, type[Codec]]:
    """A copy of the registry."""
    return dict(_REGISTRY)
