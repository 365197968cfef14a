"""System packages a test needs (a headless Chromium, SLURM's daemons), installed from Debian on first use.

``ensure_debian(packages, binaries)`` returns None when every binary is on PATH (installing the packages
with apt-get first if one is missing), or the reason it could not, for ``pytest.skip``: not root, no
apt-get, no network, a package the distribution does not have.
"""

from __future__ import annotations

import os
import shutil
import subprocess

_tried: dict[tuple[str, ...], str | None] = {}


def _missing(binaries: list[str]) -> list[str]:
    extra = os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"  # daemons live here; a non-login PATH may lack it
    return [b for b in binaries if shutil.which(b, path=os.environ.get("PATH", "") + extra) is None]


def ensure_debian(packages: list[str], binaries: list[str], timeout_s: float = 900.0) -> str | None:
    """Install ``packages`` unless all ``binaries`` exist; None on success, else why not (once per session)."""
    if not _missing(binaries):
        return None
    key = tuple(packages)
    if key in _tried:
        return _tried[key]
    reason = _install(packages, binaries, timeout_s)
    _tried[key] = reason
    return reason


def _install(packages: list[str], binaries: list[str], timeout_s: float) -> str | None:
    if shutil.which("apt-get") is None:
        return f"{', '.join(_missing(binaries))} not installed and no apt-get to install {' '.join(packages)}"
    if os.geteuid() != 0:
        return f"{', '.join(_missing(binaries))} not installed; installing {' '.join(packages)} needs root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *packages]):
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(cmd)}` took longer than {timeout_s:.0f} s"
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            return f"`{' '.join(cmd)}` failed: {tail[0]}"
    missing = _missing(binaries)
    return f"{', '.join(missing)} still missing after installing {' '.join(packages)}" if missing else None


def which(binary: str) -> str:
    """The binary's path, looking in the sbin directories too."""
    extra = os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return shutil.which(binary, path=os.environ.get("PATH", "") + extra) or binary
