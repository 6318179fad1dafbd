"""scripts/venv_install.py (what `make venv` runs) hands pip's configuration to uv unchanged."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "venv_install.py"


def _module():
    spec = importlib.util.spec_from_file_location("venv_install", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PIP_CONFIG_LIST = """\
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
global.index-url='https://mirror.example/simple'
:env:.find-links='/srv/wheels /opt/more-wheels'
:env:.default-timeout='180'
"""


def test_pip_settings_reach_uv_as_the_same_options_and_the_environment_wins():
    vi = _module()
    settings = vi.parse_pip_config(PIP_CONFIG_LIST)
    assert settings["find-links"] == "/srv/wheels /opt/more-wheels"  # PIP_FIND_LINKS over pip.conf, as pip does
    cmd, env = vi.uv_command("constraints/cpu.txt", settings)
    pairs = list(zip(cmd, cmd[1:], strict=False))
    assert ("--find-links", "/srv/wheels") in pairs and ("--find-links", "/opt/more-wheels") in pairs
    assert ("--find-links", "/opt/wheels") not in pairs
    assert ("--extra-index-url", "file:///opt/pypi/simple") in pairs
    assert ("--extra-index-url", "file:///opt/pypi-more/simple") in pairs
    assert ("--index-url", "https://mirror.example/simple") in pairs
    assert ("-c", "constraints/cpu.txt") in pairs
    assert ("--index-strategy", "unsafe-best-match") in pairs  # pip's choice: the best version over all indexes
    assert env["SSL_CERT_FILE"] == "/etc/ssl/certs/ca-certificates.crt"


def test_no_pip_configuration_gives_plain_uv():
    vi = _module()
    cmd, _ = vi.uv_command("c.txt", vi.parse_pip_config(""))
    assert "--find-links" not in cmd and "--extra-index-url" not in cmd and "--index-url" not in cmd
