"""Compression spec strings: ``name[:key=value,...]``, parsed and validated (no torch here).

One string says everything, wherever it is given (``vcga.compress.ddp_hook(spec)``, config key
``compression``, env ``VCGA_COMPRESSION``, ``vcga info --plan --compression``)::

    powersgd:rank=4              # the compressor and its options
    topk:ratio=0.01,scope=all    # plus the driver's keys, valid for every compressor
    qsgd:levels=16,when=auto     # compress a bucket only where the cost model says it pays
    none                         # (or an empty string) no compression

The driver's keys (:data:`DRIVER_KEYS`):

``scope``   ``bridge``: reduce exactly inside each vendor group / node, compress only the exchange
            across them; ``all``: compress the whole all_reduce (what torch's hooks and DeepSpeed
            do). Default: ``bridge`` where the group has more than one vendor group or node -- the
            default group, or a subgroup given with ``ddp_hook(..., data_parallel_groups=)`` --
            else ``all`` (``bridge`` needs groups every rank of the job creates together).
``when``    ``always`` (default) or ``auto``: per bucket, compress only when compression time plus
            the smaller transfer beats the plain transfer on that hop (docs/compression.md).
``start``   steps (DDP iterations) reduced exactly before compression starts (default 0).
``seed``    the seed every rank shares for the compressors' random draws (default 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vcga.compress.syntax import NONE, split_spec
from vcga.errors import VcgaConfigError

if TYPE_CHECKING:
    from vcga.contract import CompressorSpec

__all__ = ["CompressionSpec", "DRIVER_KEYS", "SCOPES", "WHEN", "parse_spec", "configured_spec", "split_spec", "NONE"]

#: Scopes a spec may name.
SCOPES = ("bridge", "all")
#: Policies for ``when``.
WHEN = ("always", "auto")


def _scope(v: str) -> str:
    if v not in SCOPES:
        raise ValueError("one of " + ", ".join(SCOPES))
    return v


def _when(v: str) -> str:
    if v not in WHEN:
        raise ValueError("one of " + ", ".join(WHEN))
    return v


def _nonneg_int(v: str) -> int:
    try:
        i = int(v)
    except ValueError:
        raise ValueError("an integer >= 0") from None
    if i < 0:
        raise ValueError("an integer >= 0")
    return i


#: The keys every spec accepts besides its compressor's own: key -> (default, parser, help).
DRIVER_KEYS: Mapping[str, tuple[Any, Any, str]] = {
    "scope": (None, _scope, "bridge (compress only across vendor groups / nodes) or all; default: bridge "
                            "on a mixed-vendor or multi-node default group, else all"),
    "when": ("always", _when, "always, or auto (compress a bucket only where the link's cost model says it pays)"),
    "start": (0, _nonneg_int, "steps reduced exactly before compression starts"),
    "seed": (0, _nonneg_int, "the seed every rank shares for random draws"),
}


@dataclass(frozen=True)
class CompressionSpec:
    """A parsed, validated spec. ``name`` is None for no compression.

    :ivar options: the compressor's options, every one present (defaults filled in).
    :ivar scope: "bridge", "all", or None (decided from the group: bridge where there is a slow hop).
    """

    name: str | None
    options: Mapping[str, Any] = field(default_factory=dict)
    scope: str | None = None
    when: str = "always"
    start: int = 0
    seed: int = 0
    text: str = NONE

    @property
    def enabled(self) -> bool:
        return self.name is not None

    def canonical(self) -> str:
        """The spec with every key spelled out (what ``vcga info`` shows)."""
        if self.name is None:
            return NONE
        keys = [f"{k}={_fmt(v)}" for k, v in self.options.items()]
        keys += [f"scope={self.scope or 'default'}", f"when={self.when}", f"start={self.start}", f"seed={self.seed}"]
        return f"{self.name}:" + ",".join(keys)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "options": dict(self.options), "scope": self.scope, "when": self.when,
                "start": self.start, "seed": self.seed, "text": self.text}


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def configured_spec() -> CompressionSpec:
    """The compression the configuration asks for (config ``compression`` / env
    ``VCGA_COMPRESSION``), parsed; a disabled spec when it is unset or "none". What ``ddp_hook()``
    and the framework adapters take when given no spec.

    :raises VcgaConfigError: a bad configured spec, naming its source.
    """
    from vcga.config import load_config

    return parse_spec(load_config().compression or None, source="config compression / env VCGA_COMPRESSION")


def parse_spec(text: str | CompressionSpec | None, registry: Mapping[str, CompressorSpec] | None = None,
               source: str = "") -> CompressionSpec:
    """Parse and validate a spec against the registered compressors.

    :param registry: compressor name -> :class:`~vcga.contract.CompressorSpec`; default: every
        compressor the plugin manager loaded.
    :raises VcgaConfigError: unknown compressor (listing the known ones), unknown key (listing the
        compressor's and the driver's keys), or a value its parser refuses (saying what is allowed).
    """
    if isinstance(text, CompressionSpec):
        return text
    if text is None:
        return CompressionSpec(None)
    name, pairs = split_spec(text, source)
    if name is None:
        return CompressionSpec(None, text=NONE)
    if registry is None:
        from vcga.plugin_manager import get_plugin_manager

        registry = {s.name: s for _, s in get_plugin_manager().compressors()}
    spec = registry.get(name)
    if spec is None:
        raise VcgaConfigError("compression", text, "a registered compressor: " + (", ".join(sorted(registry)) or
                              "(none loaded; see `vcga info`)") + ", or none", source)
    options = {k: o.default for k, o in spec.options.items()}
    driver = {k: d for k, (d, _, _) in DRIVER_KEYS.items()}
    for key, value in pairs.items():
        if key in spec.options:
            parse, what = spec.options[key].parse, spec.options[key].help
            target = options
        elif key in DRIVER_KEYS:
            _, parse, what = DRIVER_KEYS[key]
            target = driver
        else:
            known = ", ".join([*spec.options, *DRIVER_KEYS])
            raise VcgaConfigError("compression", text, f"keys of {name}: {known} (not {key!r})", source)
        try:
            target[key] = parse(value)
        except (ValueError, TypeError) as e:
            raise VcgaConfigError("compression", text, f"{name} {key}: {e or what}", source) from None
    return CompressionSpec(name, options, driver["scope"], driver["when"], driver["start"], driver["seed"],
                           text.strip())
