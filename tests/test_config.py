"""The unified config: defaults, YAML, env overrides, and errors that name key and allowed values."""

from __future__ import annotations

import pytest

from vcga.config import Config, gloo_env, load_config, parse_sim_vendors
from vcga.errors import VcgaConfigError


def test_defaults_without_file_or_env():
    assert load_config(env={}) == Config()


def test_yaml_then_env_precedence(tmp_path):
    f = tmp_path / "vcga.yaml"
    f.write_text("backend: gloo\ncollective_timeout_s: 12\nvisible_devices: [0, 2]\ndeterministic: true\n")
    cfg = load_config(f, env={})
    assert (cfg.backend, cfg.collective_timeout_s, cfg.visible_devices, cfg.deterministic) == ("gloo", 12.0, (0, 2), True)
    cfg = load_config(f, env={"VCGA_TIMEOUT": "3.5", "VCGA_VISIBLE_DEVICES": "1,3", "VCGA_DETERMINISTIC": "off"})
    assert (cfg.collective_timeout_s, cfg.visible_devices, cfg.deterministic) == (3.5, (1, 3), False)


def test_config_file_from_env_var(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("buffer_size_mb: 64\n")
    assert load_config(env={"VCGA_CONFIG": str(f)}).buffer_size_mb == 64


@pytest.mark.parametrize(
    "env, key, fragment",
    [
        ({"VCGA_TIMEOUT": "soon"}, "collective_timeout_s", "seconds > 0"),
        ({"VCGA_TIMEOUT": "-1"}, "collective_timeout_s", "seconds > 0"),
        ({"VCGA_TIMEOUT": "inf"}, "collective_timeout_s", "seconds > 0"),
        ({"VCGA_BUFFER_SIZE_MB": "0"}, "buffer_size_mb", "between 1 and 65536"),
        ({"VCGA_BUFFER_SIZE_MB": "1.5"}, "buffer_size_mb", "integer"),
        ({"VCGA_VISIBLE_DEVICES": "0,x"}, "visible_devices", "device indices"),
        ({"VCGA_VISIBLE_DEVICES": "1,1"}, "visible_devices", "distinct"),
        ({"VCGA_DETERMINISTIC": "maybe"}, "deterministic", "true or false"),
        ({"VCGA_DEBUG": "2"}, "debug", "true or false"),
        ({"VCGA_BACKEND": "no spaces allowed"}, "backend", "backend name"),
        ({"VCGA_SIM_VENDORS": "nccl:2,foo:1"}, "sim_vendors", "nccl/hccl/cncl"),
        ({"VCGA_SIM_VENDORS": "nccl:0"}, "sim_vendors", "vendor:count"),
        ({"VCGA_NETWORK_INTERFACE": "eth0;rm -rf"}, "network_interface", "interface names"),
        ({"VCGA_NETWORK_INTERFACE": "a-name-longer-than-15"}, "network_interface", "interface names"),
        ({"VCGA_NETWORK_TRAFFIC_CLASS": "105"}, "network_traffic_class", "multiple of 4"),
        ({"VCGA_NETWORK_TRAFFIC_CLASS": "256"}, "network_traffic_class", "between 0 and 252"),
        ({"VCGA_NETWORK_SERVICE_LEVEL": "8"}, "network_service_level", "between 0 and 7"),
        ({"VCGA_NETWORK_SERVICE_LEVEL": "high"}, "network_service_level", "between 0 and 7"),
        ({"VCGA_BRIDGE_PIPELINE": "sometimes"}, "bridge_pipeline", "one of auto, on, off"),
    ],
)
def test_bad_env_values_name_key_source_and_allowed(env, key, fragment):
    with pytest.raises(VcgaConfigError) as ei:
        load_config(env=env)
    msg = str(ei.value)
    assert ei.value.key == key and key in msg and fragment in msg
    assert f"env {next(iter(env))}" in msg


def test_yaml_errors(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("timeout: 3\n")  # not a key
    with pytest.raises(VcgaConfigError, match="one of the keys backend, collective_timeout_s"):
        load_config(f, env={})
    f.write_text("[1, 2]\n")
    with pytest.raises(VcgaConfigError, match="mapping"):
        load_config(f, env={})
    f.write_text("backend: [unclosed\n")
    with pytest.raises(VcgaConfigError, match="valid YAML"):
        load_config(f, env={})
    with pytest.raises(VcgaConfigError, match="readable YAML file"):
        load_config(tmp_path / "missing.yaml", env={})
    f.write_text("collective_timeout_s: true\n")
    with pytest.raises(VcgaConfigError, match=str(f)):
        load_config(f, env={})


def test_parse_sim_vendors():
    assert parse_sim_vendors("nccl:1, hccl:2,cncl:1") == [("nccl", 1), ("hccl", 2), ("cncl", 1)]


def test_network_section_from_yaml_and_env(tmp_path):
    f = tmp_path / "vcga.yaml"
    f.write_text("network:\n  interface: [eth1, ib0]\n  traffic_class: 104\n  service_level: 3\n")
    cfg = load_config(f, env={})
    assert (cfg.network_interface, cfg.network_traffic_class, cfg.network_service_level) == (("eth1", "ib0"), 104, 3)
    assert cfg.to_dict()["network_interface"] == ["eth1", "ib0"]
    cfg = load_config(f, env={"VCGA_NETWORK_INTERFACE": "eth2", "VCGA_NETWORK_SERVICE_LEVEL": "null"})
    assert (cfg.network_interface, cfg.network_traffic_class, cfg.network_service_level) == (("eth2",), 104, None)
    assert gloo_env(cfg) == {"GLOO_SOCKET_IFNAME": "eth2"} and gloo_env(Config()) == {}


def test_network_section_errors_in_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("network:\n  iface: eth1\n")
    with pytest.raises(VcgaConfigError, match="interface, traffic_class, service_level"):
        load_config(f, env={})
    f.write_text("network_interface: eth1\n")  # the section is the YAML spelling
    with pytest.raises(VcgaConfigError, match="one of the keys .*network"):
        load_config(f, env={})


def test_bridge_pipeline_modes_and_boolean_spellings():
    assert load_config(env={}).bridge_pipeline == "auto"
    for text, mode in (("OFF", "off"), ("on", "on"), ("auto", "auto"), ("0", "off"), ("1", "on"), ("no", "off")):
        assert load_config(env={"VCGA_BRIDGE_PIPELINE": text}).bridge_pipeline == mode, text


def test_config_is_a_frozen_dataclass():
    """What ``@dataclass(frozen=True)`` gave Config, from vcga._values' methods: keyword
    construction with defaults, a dataclass's fields, replace and asdict, equality and hash by
    value, frozen fields, copies and pickles that keep every field."""
    import copy
    import dataclasses
    import pickle

    default = Config()
    cfg = Config(backend="gloo", visible_devices=(0, 1))
    assert dataclasses.is_dataclass(Config) and [f.name for f in dataclasses.fields(Config)][:2] == ["backend",
                                                                                                      "collective_timeout_s"]
    assert (cfg.backend, cfg.collective_timeout_s, default.backend) == ("gloo", 300.0, "auto")
    assert dataclasses.replace(default, backend="gloo", visible_devices=(0, 1)) == cfg != default
    assert hash(dataclasses.replace(cfg)) == hash(cfg) and len({Config(), Config(), cfg}) == 2
    assert dataclasses.asdict(cfg)["visible_devices"] == (0, 1) and cfg.to_dict()["visible_devices"] == [0, 1]
    assert pickle.loads(pickle.dumps(cfg)) == cfg == copy.deepcopy(cfg) and copy.copy(cfg) is not cfg
    assert repr(default).startswith("Config(backend='auto', collective_timeout_s=300.0, ")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.backend = "nccl"
    with pytest.raises(dataclasses.FrozenInstanceError):
        del cfg.debug
    with pytest.raises(TypeError, match="unexpected keyword argument 'bakend'"):
        Config(bakend="gloo")
