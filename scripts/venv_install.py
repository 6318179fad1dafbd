"""Install the project with its test and lint extras into a venv: with uv when it can, with pip otherwise.

Usage (what `make venv` runs): VENV/bin/python scripts/venv_install.py CONSTRAINTS [REQUIREMENT...]

Without REQUIREMENT it installs the checkout, editable, with its test and lint extras; `make wheel-venv`
names a built wheel instead (a user's install, for benchmarks/startup.py).

Why uv: pip installs the ~150 wheels of torch, Ray, Lightning and the rest one after another; uv
unpacks them in parallel. On the 2-core reference machine, into a fresh venv with empty caches, pip
took 38.5 s and uv 5.1 s for the same requirements (docs/testing.md, "The venv"), and every fresh
`make test` and `make verify` starts with this step.

Why pip's configuration is handed over: uv does not read pip.conf or PIP_* variables, and a machine
is often set up through them (a local wheel directory holding the CPU build of torch, a local
mirror, a company CA). Each setting pip would use (`pip config list`) is passed to uv as the same
option, and uv chooses as pip does (the best version over all indexes), so both install the same
wheels. Anything unexpected -- no uv on the index, uv failing -- falls back to pip.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]


def pip_settings() -> dict[str, str]:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    return parse_pip_config(out)


def parse_pip_config(out: str) -> dict[str, str]:
    """pip's effective configuration from `pip config list` (lines `section.key='value'`): the
    environment (`:env:`) overrides the files, as it does for pip itself."""
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in out.splitlines():
        name, sep, value = line.partition("=")
        if not sep:
            continue
        section, _, key = name.partition(".")
        value = value.strip().strip("'\"")
        if section == ":env:":
            env[key] = value
        elif section in ("global", "install"):
            files[key] = value
    return {**files, **env}


#: What `make venv` installs: the checkout, editable, with the extras the tests and the linters need.
EDITABLE = ("-e", f"{PROJECT}[test,lint]")


def uv_command(constraints: str, settings: dict[str, str],
               requirements: tuple[str, ...] | list[str] = EDITABLE) -> tuple[list[str], dict[str, str]]:
    uv = str(Path(sys.executable).with_name("uv"))
    cmd = [uv, "pip", "install", "--quiet", "--python", sys.executable, "--index-strategy", "unsafe-best-match",
           "-c", constraints, *requirements]
    for link in settings.get("find-links", "").split():
        cmd += ["--find-links", link]
    if settings.get("index-url"):
        cmd += ["--index-url", settings["index-url"]]
    for url in settings.get("extra-index-url", "").split():
        cmd += ["--extra-index-url", url]
    env = dict(os.environ)
    if settings.get("cert"):
        env["SSL_CERT_FILE"] = settings["cert"]  # uv's own trust store would not know a local CA
    # uv's cache beside pip's (a fresh machine has neither): nothing is written outside the usual places.
    return cmd, env


def main() -> int:
    constraints, requirements = sys.argv[1], sys.argv[2:] or list(EDITABLE)
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    if subprocess.run([*pip, "--upgrade", "pip", "uv"]).returncode == 0:
        cmd, env = uv_command(constraints, pip_settings(), requirements)
        if subprocess.run(cmd, env=env).returncode == 0:
            return 0
        print(f"venv_install: uv failed ({shlex.join(cmd)}); installing with pip instead", file=sys.stderr)
    else:
        print("venv_install: could not install uv; installing with pip instead", file=sys.stderr)
    return subprocess.run([*pip, "--no-compile", "-c", constraints, *requirements]).returncode


if __name__ == "__main__":
    sys.exit(main())
