"""Run a throwaway local EVM chain (anvil, from the npm package @foundry-rs/anvil).

Used by tests and the demo. Each node gets its own free port, its own process group (so
stop() leaves nothing behind) and, unless told otherwise, a freshly generated mnemonic:
no private key is ever written in the repository.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import platform
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import requests
from eth_account import Account
from eth_account.signers.local import LocalAccount
from web3 import Web3

REPO_ROOT = Path(__file__).resolve().parents[1]
_LISTENING = re.compile(r"Listening on ([0-9.]+):(\d+)")
_NODE_PLATFORMS = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def block_time_from_env(name: str = "DEMO_CHAIN_BLOCK_TIME") -> float | None:
    """The chain's clock for `make demo` and `make bench`: anvil mines every N seconds (Base
    mines every 2, Ethereum every 12); unset, empty or 0: a block per transaction (automine)."""
    value = os.environ.get(name, "").strip()
    try:
        seconds = float(value) if value else 0.0
    except ValueError:
        raise AnvilError(f"{name}={value!r}: a number of seconds, e.g. 2") from None
    if seconds < 0:
        raise AnvilError(f"{name}={value!r}: a number of seconds, e.g. 2")
    return seconds or None


def confirmation_timeout_for(block_time: float) -> float:
    """How long a paid request waits for its receipt on a chain mining every `block_time`
    seconds: base-sepolia's default (30 s) at 2-second blocks, 15 blocks beyond that."""
    return max(30.0, 15 * block_time)


class AnvilError(RuntimeError):
    """anvil could not be found, did not start, or answered an RPC call with an error."""


def find_anvil_binary() -> str:
    """$ANVIL_BIN, else the binary inside node_modules/@foundry-rs/anvil-<os>-<arch>, else PATH.

    The npm package's own `anvil` entry is a node wrapper: killing it can orphan the real
    process, so we always run the platform binary directly.
    """
    override = os.environ.get("ANVIL_BIN")
    if override:
        if not os.access(override, os.X_OK):
            raise AnvilError(f"ANVIL_BIN={override!r} is not an executable file")
        return override
    system = platform.system().lower()
    arch = _NODE_PLATFORMS.get(platform.machine().lower(), platform.machine().lower())
    candidates = sorted((REPO_ROOT / "node_modules" / "@foundry-rs").glob("anvil-*/bin/anvil"))
    # Prefer the package built for this machine; fall back to any that is executable.
    candidates.sort(key=lambda p: p.parts[-3] != f"anvil-{system}-{arch}")
    for candidate in candidates:
        if os.access(candidate, os.X_OK):
            return str(candidate)
    on_path = shutil.which("anvil")
    if on_path:
        return on_path
    raise AnvilError("anvil not found: run `npm ci` in the repository root, or set ANVIL_BIN")


def derive_accounts(mnemonic: str, count: int) -> list[LocalAccount]:
    """The accounts anvil funds for `mnemonic` (standard path m/44'/60'/0'/0/i)."""
    Account.enable_unaudited_hdwallet_features()
    return [
        Account.from_mnemonic(mnemonic, account_path=f"m/44'/60'/0'/0/{i}") for i in range(count)
    ]


def new_mnemonic() -> str:
    Account.enable_unaudited_hdwallet_features()
    _account, mnemonic = Account.create_with_mnemonic()
    return mnemonic


class AnvilRpc:
    """Control of an anvil node by its RPC URL: the one a test started, or the demo's chain
    (read from var/demo-chain.json) driven from another process."""

    def __init__(self, rpc_url: str, chain_id: int = 31337) -> None:
        self.rpc_url = rpc_url
        self.chain_id = chain_id
        self._session = requests.Session()
        self._rpc_ids = itertools.count(1)

    # --- talking to it -------------------------------------------------------------------

    def w3(self) -> Web3:
        """A new Web3 client for this node."""
        return Web3(Web3.HTTPProvider(self.rpc_url, request_kwargs={"timeout": 30}))

    def rpc(self, method: str, params: Sequence[Any] = ()) -> Any:
        """Raw JSON-RPC call (anvil_*, evm_* methods that web3 has no wrapper for)."""
        body = {"jsonrpc": "2.0", "id": next(self._rpc_ids), "method": method,
                "params": list(params)}  # fmt: skip
        reply = self._session.post(self.rpc_url, json=body, timeout=30).json()
        if "error" in reply:
            raise AnvilError(f"{method}: {reply['error']}")
        return reply.get("result")

    def mine(self, blocks: int = 1) -> None:
        for _ in range(blocks):
            self.rpc("evm_mine")

    def set_automine(self, enabled: bool) -> None:
        self.rpc("evm_setAutomine", [enabled])

    def drop_transaction(self, tx_hash: str) -> None:
        """Remove a pending transaction from the pool, as if the network had lost it."""
        self.rpc("anvil_dropTransaction", [tx_hash])

    def increase_time(self, seconds: int) -> None:
        """Move the clock of the next block forward (for validBefore / validAfter)."""
        self.rpc("evm_increaseTime", [seconds])

    def set_next_block_timestamp(self, timestamp: int) -> None:
        """The next block (only) carries this time; later ones follow the wall clock again."""
        self.rpc("evm_setNextBlockTimestamp", [timestamp])


class AnvilNode(AnvilRpc):
    """A running anvil process. Use as a context manager, or call stop() yourself."""

    def __init__(
        self,
        *,
        chain_id: int = 31337,
        no_mining: bool = False,
        block_time: float | None = None,
        accounts: int = 10,
        mnemonic: str | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 30.0,
        port: int = 0,
    ) -> None:
        """`port` 0 lets anvil pick a free one (printed, and read back as `rpc_url`)."""
        self.chain_id = chain_id
        self.mnemonic = mnemonic or new_mnemonic()
        self.rpc_url = ""
        self._session = requests.Session()
        self._rpc_ids = itertools.count(1)
        self._tmpdir = tempfile.TemporaryDirectory(prefix="anvil-")
        self._log_path = Path(self._tmpdir.name) / "anvil.log"
        args = [
            find_anvil_binary(),
            "--host", "127.0.0.1",
            "--port", str(port),  # 0: anvil picks a free one and prints it, no race with others
            "--chain-id", str(chain_id),
            "--accounts", str(accounts),
            "--mnemonic", self.mnemonic,
        ]  # fmt: skip
        if no_mining:
            args.append("--no-mining")
        if block_time is not None:
            args += ["--block-time", str(block_time)]
        args += list(extra_args)
        with self._log_path.open("wb") as log:
            # A new session makes anvil the leader of its own process group, so stop()
            # can signal the whole group; output goes to a file, so no pipe can fill up.
            self._proc = subprocess.Popen(  # noqa: S603 -- fixed binary, no shell
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        atexit.register(self.stop)
        try:
            self._wait_until_ready(startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.accounts: list[LocalAccount] = derive_accounts(self.mnemonic, accounts)

    # --- lifecycle -----------------------------------------------------------------------

    def _wait_until_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise AnvilError(f"anvil exited with {self._proc.returncode}:\n{self._log_tail()}")
            if not self.rpc_url:
                match = _LISTENING.search(self._log_path.read_text(errors="replace"))
                if match:
                    self.rpc_url = f"http://{match.group(1)}:{match.group(2)}"
            if self.rpc_url:
                with contextlib.suppress(requests.RequestException, ValueError):
                    body = {"jsonrpc": "2.0", "id": 0, "method": "eth_chainId", "params": []}
                    reply = requests.post(self.rpc_url, json=body, timeout=1).json()
                    if int(reply["result"], 16) == self.chain_id:
                        return
            time.sleep(0.05)
        raise AnvilError(f"anvil did not answer within {timeout}s:\n{self._log_tail()}")

    def _log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    @property
    def running(self) -> bool:
        return self._proc.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate anvil's process group, then kill it if it lingers. Safe to call twice."""
        if self._proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, sig)
                try:
                    self._proc.wait(timeout=timeout)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._proc.wait()  # reap, even if it had already exited
        atexit.unregister(self.stop)
        self._session.close()
        self._tmpdir.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
