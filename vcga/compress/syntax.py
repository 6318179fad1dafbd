"""The syntax of a compression spec string, ``name[:key=value,...]`` or ``none``: no names checked.

:mod:`vcga.config` checks a configured spec's syntax with this when it loads; :mod:`vcga.compress.spec`
checks names and values against the registered compressors when the spec is used. This module
imports only :mod:`vcga.errors`, so the configuration can use it without depending on the plugins.
"""

from __future__ import annotations

from vcga.errors import VcgaConfigError

__all__ = ["NONE", "split_spec"]

#: What the spec says when nothing is compressed.
NONE = "none"


def split_spec(text: str, source: str = "") -> tuple[str | None, dict[str, str]]:
    """``"topk:ratio=0.01,scope=all"`` -> ``("topk", {"ratio": "0.01", "scope": "all"})``, syntax only."""
    if not isinstance(text, str):
        raise VcgaConfigError("compression", text, "a spec string like 'powersgd:rank=4' or 'none'", source)
    t = text.strip()
    if t.lower() in ("", NONE):
        return None, {}
    name, _, rest = t.partition(":")
    name = name.strip().lower()
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise VcgaConfigError("compression", text, "name[:key=value,...], e.g. powersgd:rank=4, topk:ratio=0.01, "
                              "qsgd:levels=16, bf16 -- or none", source)
    pairs: dict[str, str] = {}
    if rest.strip():
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            key, value = key.strip().lower(), value.strip()
            if not eq or not key or not value:
                raise VcgaConfigError("compression", text, f"key=value pairs after '{name}:' (got {item.strip()!r})",
                                      source)
            if key in pairs:
                raise VcgaConfigError("compression", text, f"each key once ({key!r} is given twice)", source)
            pairs[key] = value
    return name, pairs
