"""Errors raised while resolving a model config."""

from __future__ import annotations


class UnsupportedConfigError(ValueError):
    """A config field names a feature this engine does not implement (yet)."""


__all__ = ["UnsupportedConfigError"]
