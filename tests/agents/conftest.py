"""Agents that bring their own environment: the official x402 client with its sign-in-with-x
hooks needs signinwithethereum, which needs web3 < 8 and eth-account < 0.14, older than
Tollbooth's. So the tests build that client a virtualenv of its own from the pinned
tests/agents/siwx-requirements.txt (PyPI is the only thing it needs from the network) and run
it as a separate process, as an agent would run it.

The environment is cached under var/agents/, named by the requirements' hash: built once
(about 30 s), then reused until the pins change.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

REQUIREMENTS = Path(__file__).with_name("siwx-requirements.txt")


def _build(target: Path) -> None:
    building = target.with_name(target.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(building)], check=True, timeout=120)
    pip = [str(building / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "-r", str(REQUIREMENTS)], check=True, timeout=600)
    building.rename(target)


@pytest.fixture(scope="session")
def siwx_python() -> Path:
    """The interpreter of the sign-in client's own environment (built on first use)."""
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]
    home = Path(settings.VAR_DIR) / "agents"
    home.mkdir(parents=True, exist_ok=True)
    target = home / f"siwx-{digest}"
    # Two test sessions on one checkout build it once: the second waits for the first.
    with (home / "siwx.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "bin" / "python").exists():
            _build(target)
    python = target / "bin" / "python"
    check = [str(python), "-c", "import siwe, x402, web3; print(web3.__version__)"]
    assert subprocess.run(check, capture_output=True, text=True, check=True).stdout.startswith("7.")
    return python
