"""The unified configuration: one YAML file plus environment overrides, validated.

Where values come from, lowest precedence first:

1. defaults (below);
2. the YAML file named by ``VCGA_CONFIG`` (or passed to :func:`load_config`);
3. environment variables ``VCGA_<KEY>`` (see :data:`ENV`).

Every backend translates the result into its vendor's variables (``Backend.vendor_env``), so a
user sets the collective timeout once and NCCL, HCCL and CNCL each receive it in their own words.

Example file::

    backend: auto              # or a backend name: gloo, nccl, hccl, mlu, sim-hccl, ...
    collective_timeout_s: 300
    buffer_size_mb: 64
    visible_devices: [0, 1]
    deterministic: true
    network:                   # the interface between nodes, and the RoCE QoS of the vendors' traffic
      interface: eth1
      traffic_class: 104       # DSCP 26 x 4
      service_level: 3
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from vcga._values import FrozenDataclass
from vcga.errors import VcgaConfigError

__all__ = ["Config", "load_config", "ENV", "SECTIONS", "parse_sim_vendors", "SIM_VENDOR_NAMES", "gloo_env"]

#: Vendor keys accepted in ``sim_vendors`` (the collective library each simulated backend stands for).
SIM_VENDOR_NAMES = ("nccl", "hccl", "cncl")


@dataclass(init=False, repr=False, eq=False)
class Config(FrozenDataclass):
    """Validated configuration. Construct through :func:`load_config` (or with keywords).

    Frozen and compared by value, as ``@dataclass(frozen=True)`` would make it, and a dataclass
    (``dataclasses.replace`` makes a changed copy); its methods come from :mod:`vcga._values`, which
    saves each rank 0.9 ms at every start."""

    #: "auto" or a backend name. Auto picks the highest-priority available non-simulated backend.
    backend: str = "auto"
    #: One timeout for every collective and for group creation, in seconds.
    collective_timeout_s: float = 300.0
    #: Communication buffer size per peer in MiB, or None for each vendor's default.
    buffer_size_mb: int | None = None
    #: Device indices this process may use, or None for all.
    visible_devices: tuple[int, ...] | None = None
    #: Ask vendor libraries for reproducible reduction order (may cost speed).
    deterministic: bool = False
    #: Compare a fingerprint of every collective across ranks before running it.
    debug: bool = False
    #: Simulated vendor layout, e.g. "nccl:2,hccl:2" (ranks 0-1 sim-nccl, 2-3 sim-hccl).
    sim_vendors: str | None = None
    #: Mixed-vendor all_reduce algorithm: "auto" (by size and group shape), "leader", "bandwidth" or "replicated".
    bridge_algorithm: str = "auto"
    #: Mixed-vendor: shard peers on one node reduce through shared memory rather than gloo over TCP.
    bridge_shm: bool = True
    #: Mixed-vendor: collectives run on the group's communication thread and return at once (DDP
    #: overlaps them with backward); False runs each in the calling thread.
    bridge_async: bool = True
    #: Mixed-vendor, asynchronous bridge: pipeline consecutive bandwidth all_reduces (the next one's
    #: in-group reduce-scatter and exchange overlap the previous one's exchange and all-gather, on a
    #: second native group per vendor group). "auto": where every set of shard peers spans nodes;
    #: "on": also on one node with ``bridge_shm: false``; "off": one collective after the other.
    bridge_pipeline: str = "auto"
    #: Mixed-vendor: where the bridge's α–β link figures come from. "cached": rank 0's cache entry for
    #: this topology, measured at creation (and stored) when there is none; "measure": measured at
    #: every creation (the cache entry refreshed); "off": never measured (the plan's default rule).
    bridge_calibration: str = "cached"
    #: Mixed-vendor, ``bridge_algorithm: auto``: check the choice against the time the all_reduces
    #: really take and choose again where they depart from the prediction (docs/bridge.md, "Checked
    #: online"). False keeps the figures' choice (a switch changes the order of reduction: a job that
    #: needs run-to-run reproducible sums pins ``bridge_algorithm`` or sets this false).
    bridge_verify: bool = True
    #: Mixed-vendor: the directory of the link-figure cache, or None for the folder ``bridge`` of
    #: VCGA's user cache (``$VCGA_CACHE_DIR``, else ``$XDG_CACHE_HOME/vcga``, else ``~/.cache/vcga``).
    #: Only rank 0's is read and written.
    bridge_figures_cache: str | None = None
    #: The network interfaces between nodes (exact names), or None for each library's own choice.
    #: YAML: ``network: {interface: ...}``.
    network_interface: tuple[str, ...] | None = None
    #: RoCE/IB traffic class (the IP header's ToS byte: DSCP x 4), 0-252, or None for the vendor default.
    network_traffic_class: int | None = None
    #: RoCE/IB service level (the PFC priority the NICs and switches use), 0-7, or None for the vendor default.
    network_service_level: int | None = None
    #: Gradient compression for ``vcga.compress.ddp_hook()``: a spec ``name[:key=value,...]``
    #: (e.g. "powersgd:rank=4", "topk:ratio=0.01,scope=all"), or None / "none".
    compression: str | None = None
    #: Where every rank writes its flight-recorder dump (``<dir>/vcga_fr_trace_rank_<rank>``) on a
    #: collective timeout, an abort, SIGUSR1 or :func:`vcga.flight_recorder.dump`; None: where
    #: ``TORCH_FR_DUMP_TEMP_FILE`` points (``<prefix><rank>``), else the temporary directory.
    trace_dir: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.visible_devices is not None:
            d["visible_devices"] = list(self.visible_devices)
        if self.network_interface is not None:
            d["network_interface"] = list(self.network_interface)
        return d


#: Environment variable for each key.
ENV: Mapping[str, str] = {
    "backend": "VCGA_BACKEND",
    "collective_timeout_s": "VCGA_TIMEOUT",
    "buffer_size_mb": "VCGA_BUFFER_SIZE_MB",
    "visible_devices": "VCGA_VISIBLE_DEVICES",
    "deterministic": "VCGA_DETERMINISTIC",
    "debug": "VCGA_DEBUG",
    "sim_vendors": "VCGA_SIM_VENDORS",
    "bridge_algorithm": "VCGA_BRIDGE_ALGORITHM",
    "bridge_shm": "VCGA_BRIDGE_SHM",
    "bridge_async": "VCGA_BRIDGE_ASYNC",
    "bridge_pipeline": "VCGA_BRIDGE_PIPELINE",
    "bridge_calibration": "VCGA_BRIDGE_CALIBRATION",
    "bridge_verify": "VCGA_BRIDGE_VERIFY",
    "bridge_figures_cache": "VCGA_BRIDGE_FIGURES_CACHE",
    "network_interface": "VCGA_NETWORK_INTERFACE",
    "network_traffic_class": "VCGA_NETWORK_TRAFFIC_CLASS",
    "network_service_level": "VCGA_NETWORK_SERVICE_LEVEL",
    "compression": "VCGA_COMPRESSION",
    "trace_dir": "VCGA_TRACE_DIR",
}

#: The YAML section ``network:`` and the keys it holds (``network: {interface: eth1}`` sets
#: ``network_interface``).
SECTIONS: Mapping[str, tuple[str, ...]] = {"network": ("interface", "traffic_class", "service_level")}

_ALLOWED = {
    "backend": "'auto' or a backend name (see `vcga info`), e.g. gloo, nccl, hccl, mlu, sim-nccl",
    "collective_timeout_s": "a number of seconds > 0",
    "buffer_size_mb": "an integer number of MiB between 1 and 65536, or null",
    "visible_devices": "a list of device indices >= 0 (YAML list or comma-separated), or null / 'all'",
    "deterministic": "true or false (env: 1/0, true/false, yes/no, on/off)",
    "debug": "true or false (env: 1/0, true/false, yes/no, on/off)",
    "sim_vendors": "comma-separated vendor:count pairs with vendors from "
    + "/".join(SIM_VENDOR_NAMES) + ", e.g. 'nccl:2,hccl:2', or null",
    "bridge_algorithm": "one of auto, leader, bandwidth, replicated (see docs/bridge.md)",
    "bridge_shm": "true or false (env: 1/0, true/false, yes/no, on/off)",
    "bridge_async": "true or false (env: 1/0, true/false, yes/no, on/off)",
    "bridge_pipeline": "one of auto, on, off (env also 1/0, true/false, yes/no; see docs/bridge.md, "
    "'Pipelining across collectives')",
    "bridge_calibration": "one of cached, measure, off (see docs/bridge.md, 'Calibration cache')",
    "bridge_verify": "true or false (env: 1/0, true/false, yes/no, on/off)",
    "bridge_figures_cache": "a directory path, or null for VCGA's user cache (~/.cache/vcga/bridge)",
    "trace_dir": "a directory path, or null for TORCH_FR_DUMP_TEMP_FILE's prefix (else the temporary directory)",
    "network_interface": "interface names as the OS shows them (`ip link`), a YAML list or comma-separated, "
    "e.g. eth1 or 'ib0,ib1'; or null for each library's own choice",
    "network_traffic_class": "an integer multiple of 4 between 0 and 252 (the ToS byte: DSCP x 4; the low two "
    "bits are ECN, which HCCL_RDMA_TC requires zero), or null",
    "network_service_level": "an integer between 0 and 7 (the NIC's PFC priority), or null",
    "compression": "a compression spec name[:key=value,...] such as powersgd:rank=4, topk:ratio=0.01, "
    "qsgd:levels=16, fp16, bf16, sign; or none (see docs/compression.md)",
}

#: The values of ``bridge_calibration``.
CALIBRATION_MODES = ("cached", "measure", "off")
#: The values of ``bridge_pipeline``.
PIPELINE_MODES = ("auto", "on", "off")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _bool(key: str, v: Any, src: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise VcgaConfigError(key, v, _ALLOWED[key], src)


def _validate(key: str, v: Any, src: str) -> Any:
    if key == "backend":
        if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", v.strip()):
            raise VcgaConfigError(key, v, _ALLOWED[key], src)
        return v.strip()
    if key == "collective_timeout_s":
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise VcgaConfigError(key, v, _ALLOWED[key], src) from None
        if isinstance(v, bool) or not (f > 0) or f == float("inf"):
            raise VcgaConfigError(key, v, _ALLOWED[key], src)
        return f
    if key == "buffer_size_mb":
        if v is None or (isinstance(v, str) and v.strip().lower() in ("", "null", "none", "default")):
            return None
        try:
            i = int(v)
        except (TypeError, ValueError):
            raise VcgaConfigError(key, v, _ALLOWED[key], src) from None
        if isinstance(v, bool) or isinstance(v, float) and v != i or not (1 <= i <= 65536):
            raise VcgaConfigError(key, v, _ALLOWED[key], src)
        return i
    if key == "visible_devices":
        if v is None or (isinstance(v, str) and v.strip().lower() in ("", "all", "null", "none")):
            return None
        items = v.split(",") if isinstance(v, str) else v
        if isinstance(items, int) and not isinstance(items, bool):
            items = [items]
        if not isinstance(items, (list, tuple)):
            raise VcgaConfigError(key, v, _ALLOWED[key], src)
        out = []
        for it in items:
            try:
                i = int(str(it).strip()) if not isinstance(it, bool) else -1
            except ValueError:
                raise VcgaConfigError(key, v, _ALLOWED[key], src) from None
            if i < 0:
                raise VcgaConfigError(key, v, _ALLOWED[key], src)
            out.append(i)
        if len(set(out)) != len(out):
            raise VcgaConfigError(key, v, "a list of distinct device indices", src)
        return tuple(out)
    if key in ("deterministic", "debug", "bridge_shm", "bridge_async", "bridge_verify"):
        return _bool(key, v, src)
    if key == "sim_vendors":
        if v is None or (isinstance(v, str) and not v.strip()):
            return None
        if not isinstance(v, str):
            raise VcgaConfigError(key, v, _ALLOWED[key], src)
        parse_sim_vendors(v, src)
        return v.replace(" ", "")
    if key == "network_interface":
        if v is None or (isinstance(v, str) and v.strip().lower() in ("", "null", "none", "default")):
            return None
        items = [x.strip() for x in v.split(",")] if isinstance(v, str) else v
        if not isinstance(items, (list, tuple)) or not items or not all(
                isinstance(x, str) and re.fullmatch(r"[A-Za-z0-9_.:@-]{1,15}", x) for x in items):
            raise VcgaConfigError(key, v, _ALLOWED[key], src)
        return tuple(items)
    if key in ("network_traffic_class", "network_service_level"):
        if v is None or (isinstance(v, str) and v.strip().lower() in ("", "null", "none", "default")):
            return None
        try:
            i = int(str(v).strip()) if not isinstance(v, (bool, float)) else -1
        except ValueError:
            raise VcgaConfigError(key, v, _ALLOWED[key], src) from None
        ok = 0 <= i <= 252 and i % 4 == 0 if key == "network_traffic_class" else 0 <= i <= 7
        if not ok:
            raise VcgaConfigError(key, v, _ALLOWED[key], src)
        return i
    if key == "bridge_pipeline":
        if isinstance(v, bool):  # YAML 1.1 reads a bare on / off as a bool
            return "on" if v else "off"
        text = v.strip().lower() if isinstance(v, str) else None
        if text in _TRUE - {"on"} or text in _FALSE - {"off", ""}:  # the booleans' spellings: 1/0, yes/no, ...
            return "on" if text in _TRUE else "off"
        if text not in PIPELINE_MODES:
            raise VcgaConfigError(key, v, _ALLOWED[key], src)
        return text
    if key == "bridge_calibration":
        if not isinstance(v, str) or v.strip().lower() not in CALIBRATION_MODES:
            raise VcgaConfigError(key, v, _ALLOWED[key], src)
        return v.strip().lower()
    if key in ("bridge_figures_cache", "trace_dir"):
        if v is None or (isinstance(v, str) and v.strip().lower() in ("", "null", "none")):
            return None
        if not isinstance(v, (str, os.PathLike)):
            raise VcgaConfigError(key, v, _ALLOWED[key], src)
        return os.path.expanduser(os.fspath(v).strip())
    if key == "bridge_algorithm":
        if not isinstance(v, str) or v.strip().lower() not in ("auto", "leader", "bandwidth", "replicated"):
            raise VcgaConfigError(key, v, _ALLOWED[key], src)
        return v.strip().lower()
    if key == "compression":
        if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none", "null")):
            return None
        if not isinstance(v, str):
            raise VcgaConfigError(key, v, _ALLOWED[key], src)
        from vcga.compress.syntax import split_spec  # where a spec is set: a job without one never loads vcga.compress

        split_spec(v, src)  # syntax here; names and values when the spec is used (vcga.compress.spec)
        return v.strip()
    raise AssertionError(key)  # pragma: no cover - keys come from fields(Config)


def parse_sim_vendors(spec: str, source: str = "") -> list[tuple[str, int]]:
    """Parse ``"nccl:2,hccl:2"`` into ``[("nccl", 2), ("hccl", 2)]``, validating every part."""
    out: list[tuple[str, int]] = []
    for part in spec.replace(" ", "").split(","):
        m = re.fullmatch(r"([a-z]+):(\d+)", part)
        if not m or m.group(1) not in SIM_VENDOR_NAMES or int(m.group(2)) < 1:
            raise VcgaConfigError("sim_vendors", spec, _ALLOWED["sim_vendors"], source)
        out.append((m.group(1), int(m.group(2))))
    return out


def load_config(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Read defaults, then the YAML file, then environment overrides; validate every value.

    :param path: a YAML file; default: ``$VCGA_CONFIG`` if set, else no file.
    :param env: the environment to read (default ``os.environ``).
    :raises VcgaConfigError: naming the key, the value, where it came from, and what is allowed.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    keys = [f.name for f in fields(Config)]
    file = path if path is not None else env.get("VCGA_CONFIG") or None
    if file is not None:
        values.update(_read_yaml(Path(file), keys))
    for key in keys:
        var = ENV[key]
        if var in env:
            values[key] = _validate(key, env[var], f"env {var}")
    return replace(Config(), **values)


def _read_yaml(path: Path, keys: list[str]) -> dict[str, Any]:
    import yaml  # only when a file is given

    src = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise VcgaConfigError("VCGA_CONFIG", src, "a readable YAML file", f"{e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise VcgaConfigError("VCGA_CONFIG", src, f"valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise VcgaConfigError("VCGA_CONFIG", src, "a YAML mapping of config keys at the top level")
    out = {}
    top = [k for k in keys if not any(k.startswith(f"{s}_") for s in SECTIONS)] + list(SECTIONS)
    for k, v in data.items():
        if k in SECTIONS:
            if v is None:
                continue
            if not isinstance(v, dict) or any(sub not in SECTIONS[k] for sub in v):
                raise VcgaConfigError(str(k), v, f"a mapping with the keys {', '.join(SECTIONS[k])}", src)
            for sub, sv in v.items():
                out[f"{k}_{sub}"] = _validate(f"{k}_{sub}", sv, src)
            continue
        if k not in top:
            raise VcgaConfigError(str(k), v, "one of the keys " + ", ".join(top), src)
        out[k] = _validate(k, v, src)
    return out


def gloo_env(config: Config) -> dict[str, str]:
    """What gloo reads from the unified config: ``GLOO_SOCKET_IFNAME`` (torch's ProcessGroupGloo
    makes one device per listed interface when it is set, else resolves the host name). The gloo
    backend and the simulated vendors (gloo underneath) translate through it, and so does the
    mixed-vendor bridge, whose exchange between nodes is gloo whatever the vendors are."""
    if config.network_interface is None:
        return {}
    return {"GLOO_SOCKET_IFNAME": ",".join(config.network_interface)}
