"""`make rehearsal`: production's shape against a local chain that impersonates Base mainnet.

    DATABASE_URL=postgres://... REDIS_URL=redis://... make rehearsal

What runs (docs/rehearsal.md): anvil with `--chain-id 8453 --block-time 2`; the project's test
token (devtools/test_token.py) at Base's USDC address with its EIP-712 name and version
written into storage ("USD Coin", "2"), minted by the account that deployed it; Tollbooth under
`config.settings.production` on PostgreSQL (database `tollbooth_rehearsal` on DATABASE_URL's
server, dropped and created each run) and Redis (REHEARSAL_REDIS_DB, default 15, flushed), run
by `scripts/serve.py` (gunicorn, a Celery worker, beat), the shipped `eip155:8453` entry as it
is but for its RPC URL and keys, generated for this run; the catalog applied from a file; the
stock x402 Python client buying once with the direct relayer and once through the
CDP-authenticated facilitator double; the first purchase refunded from the refund wallet.
Each claim is checked against the chain and the book of record; the table at the end says what
was proved. Exits non-zero at the first claim that does not hold.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis
import requests
from cryptography.hazmat.primitives.asymmetric import ed25519
from eth_account import Account
from psycopg import sql

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from devtools.anvil import AnvilNode  # noqa: E402
from devtools.facilitator_double import FacilitatorDouble  # noqa: E402
from devtools.test_token import mint, place_test_usdc_at  # noqa: E402
from payments.chain.token import token_contract  # noqa: E402

NETWORK = "eip155:8453"
BASE_USDC = "0x833589fCD6eDb6E08f4c7C32D4f71b54bdA02913"
PRICE = 50_000  # 0.05 USDC: under the stock client's default cap of 1 USDC
SLUG = "rehearsal-report"
CONFIRMATIONS = 3  # the shipped X402_BASE_CONFIRMATIONS, not overridden here
FINALIZED_LAG = 64  # anvil's `finalized` tag trails the head by 64 blocks
CDP_KEY_ID = "organizations/rehearsal/apiKeys/rehearsal"
PYTHON = sys.executable
T0 = time.monotonic()


class RehearsalFailed(RuntimeError):
    pass


def say(text: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {text}", flush=True)


def require(condition: object, claim: str) -> None:
    if not condition:
        raise RehearsalFailed(claim)


def wait_until(probe: Callable[[], Any], what: str, timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.5)
    raise RehearsalFailed(f"timed out waiting for {what}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# --- the services: a database and a Redis db of its own -----------------------------------


def own_database(server_url: str) -> str:
    """Drop and create `tollbooth_rehearsal` (REHEARSAL_DATABASE_NAME) on the server of
    DATABASE_URL, so a run never touches the suite's or anyone's data: the name must end in
    `rehearsal` and differ from the database DATABASE_URL names."""
    parts = urlsplit(server_url)
    require(parts.scheme.startswith("postg"), "DATABASE_URL must name a PostgreSQL server")
    name = os.environ.get("REHEARSAL_DATABASE_NAME", "tollbooth_rehearsal")
    require(
        name.endswith("rehearsal") and name != parts.path.strip("/"),
        f"REHEARSAL_DATABASE_NAME={name!r}: a database of its own, its name ending in rehearsal",
    )
    admin = urlunsplit(parts._replace(scheme="postgresql", path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return urlunsplit(parts._replace(path=f"/{name}"))


def own_redis(server_url: str) -> str:
    """Redis db REHEARSAL_REDIS_DB (default 15) on REDIS_URL's server, flushed: never the db
    REDIS_URL itself names (a suite or a deployment may be using it)."""
    parts = urlsplit(server_url)
    db = os.environ.get("REHEARSAL_REDIS_DB", "15")
    require(parts.path.strip("/") != db, f"REHEARSAL_REDIS_DB={db} must differ from REDIS_URL's")
    url = urlunsplit(parts._replace(path=f"/{db}"))
    redis.Redis.from_url(url).flushdb()
    return url


# --- the chain -----------------------------------------------------------------------------


def chain_up(anvil: AnvilNode) -> dict[str, Any]:
    """Base's USDC placed and verified; every key generated now, funded with gas."""
    w3 = anvil.w3()
    deployer, double_relayer = anvil.accounts[0], anvil.accounts[1]
    token = place_test_usdc_at(anvil, BASE_USDC, deployer, name="USD Coin", version="2")
    owner = token_contract(w3, BASE_USDC).functions.owner().call()
    require(owner == deployer.address, f"the token's minter is its deployer ({owner})")
    keys = {role: Account.create() for role in ("relayer", "refund_wallet", "buyer", "seller")}
    for account in (*keys.values(), double_relayer):
        anvil.rpc("anvil_setBalance", [account.address, hex(10**18)])
    mint(w3, BASE_USDC, deployer, keys["buyer"].address, 1_000_000)
    mint(w3, BASE_USDC, deployer, keys["refund_wallet"].address, 1_000_000)
    return {"token": token, "keys": keys, "double_relayer": double_relayer, "deployer": deployer}


def balance(anvil: AnvilNode, address: str) -> int:
    return int(token_contract(anvil.w3(), BASE_USDC).functions.balanceOf(address).call())


def transfer_in(anvil: AnvilNode, tx_hash: str, sender: str, to: str, value: int) -> dict:
    """The transaction's receipt, once it holds a successful Transfer of `value` of Base's
    USDC from `sender` to `to`."""
    w3 = anvil.w3()
    receipt = w3.eth.get_transaction_receipt(tx_hash)  # type: ignore[arg-type]
    require(receipt["status"] == 1, f"{tx_hash} succeeded")
    topic = w3.keccak(text="Transfer(address,address,uint256)")
    moved = [
        log
        for log in receipt["logs"]
        if log["address"].lower() == BASE_USDC.lower()
        and log["topics"][0] == topic
        and "0x" + log["topics"][1].hex()[-40:] == sender.lower()
        and "0x" + log["topics"][2].hex()[-40:] == to.lower()
        and int.from_bytes(log["data"], "big") == value
    ]
    require(moved, f"{tx_hash} moves {value} USDC from {sender} to {to}")
    return dict(receipt)


# --- Tollbooth -----------------------------------------------------------------------------


def tollbooth_env(chain: dict[str, Any], rpc_url: str, db: str, cache: str, var: Path) -> dict:
    keys = chain["keys"]
    port = free_port()
    hexkey = {role: "0x" + bytes(account.key).hex() for role, account in keys.items()}
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("X402_", "CDP_", "DJANGO_"))},
        "DJANGO_SETTINGS_MODULE": "config.settings.production",
        "DATABASE_URL": db,
        "REDIS_URL": cache,
        "DJANGO_SECRET_KEY": base64.b64encode(os.urandom(48)).decode(),
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1",
        "DJANGO_SECURE_SSL_REDIRECT": "False",  # no TLS in front of a rehearsal
        "TOLLBOOTH_METRICS_TOKEN": os.urandom(16).hex(),
        "TOLLBOOTH_RECEIPT_KEY": "0x" + os.urandom(32).hex(),
        "TOLLBOOTH_PUBLIC_URL": f"http://127.0.0.1:{port}",
        "TOLLBOOTH_VAR_DIR": str(var),
        "GUNICORN_BIND": f"127.0.0.1:{port}",
        "GUNICORN_WORKERS": "1",
        "CELERY_CONCURRENCY": "1",
        "X402_RESULT_WAIT_SECONDS": "30",
        # The shipped eip155:8453 entry, but for its RPC URL and keys:
        "X402_BASE_RPC_URL": rpc_url,
        "X402_BASE_RELAYER_KEY": hexkey["relayer"],
        "X402_BASE_REFUND_WALLET_KEY": hexkey["refund_wallet"],
        "TOLLBOOTH_PAYOUT_DAILY_CAPS": f"{BASE_USDC}=1000000",
    }


def manage(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [PYTHON, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    require(done.returncode == 0, f"manage.py {' '.join(args)}:\n{done.stdout}{done.stderr}")
    return done.stdout


def catalog_file(var: Path, seller: str) -> Path:
    path = var / "offerings.yaml"
    path.write_text(
        "tollbooth_catalog: 1\n"
        "defaults:\n"
        f"  network: {NETWORK}\n"
        f'  asset: "{BASE_USDC}"\n'
        f'  pay_to: "{seller}"\n'
        "offerings:\n"
        f"  {SLUG}:\n"
        "    title: Rehearsal report\n"
        f"    price: {PRICE}\n"
        "    executor: report\n"
        "    input_schema: {type: object, required: [title, csv]}\n"
    )
    return path


@contextlib.contextmanager
def serving(env: dict[str, str], var: Path, leg: str) -> Iterator[str]:
    """`scripts/serve.py web worker beat` (as `make serve` runs them) until /healthz answers."""
    log = (var / f"serve-{leg}.log").open("w")
    serve = subprocess.Popen(
        [PYTHON, "scripts/serve.py", "web", "worker", "beat"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = env["TOLLBOOTH_PUBLIC_URL"]
    try:

        def alive() -> bool:
            require(
                serve.poll() is None, f"serve.py exited: {(var / f'serve-{leg}.log').read_text()}"
            )
            with contextlib.suppress(requests.RequestException):
                return requests.get(f"{url}/healthz", timeout=2).status_code == 200
            return False

        wait_until(alive, "gunicorn to answer /healthz", timeout=120)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(serve.pid, signal.SIGTERM)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
        log.close()


def stock_buy(url: str, buyer: Any, title: str) -> dict[str, Any]:
    """docs/examples/x402_buy.py, the stock x402 Python client: no allow-list (Base's USDC is
    one it knows), its default 1 USDC cap."""
    body = {"title": title, "csv": "region,units\nnorth,3\nsouth,5\n"}
    env = {**os.environ, "BUYER_KEY": "0x" + bytes(buyer.key).hex(), "NETWORK": NETWORK}
    env.pop("TOKEN", None)
    done = subprocess.run(
        [PYTHON, "docs/examples/x402_buy.py", f"{url}/x402/{SLUG}", json.dumps(body)],
        cwd=ROOT,
        env={**env, "TIMEOUT": "90"},
        capture_output=True,
        text=True,
        timeout=150,
    )
    require(done.returncode == 0, f"the stock client failed: {done.stderr[-2000:]}")
    got: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    require(got.get("status") == 200, f"the stock client got {got}")
    return got


def purchase_leg(leg: str, url: str, anvil: AnvilNode, chain: dict, title: str) -> dict:
    """One purchase: the client's 200 and its settlement, checked on chain and in the book."""
    from x402.http.utils import decode_payment_response_header

    from payments.models import PaymentAttempt

    keys = chain["keys"]
    got = stock_buy(url, keys["buyer"], title)
    head = anvil.w3().eth.block_number
    settle = decode_payment_response_header(got["headers"]["payment-response"])
    require(settle.success and settle.network == NETWORK, f"{leg}: settled on {NETWORK}")
    attempt = PaymentAttempt.objects.select_related("purchase").get(tx_hash=settle.transaction)
    sender = keys["relayer"].address if leg == "direct" else chain["double_relayer"].address
    receipt = transfer_in(
        anvil, settle.transaction, keys["buyer"].address, keys["seller"].address, PRICE
    )
    require(receipt["from"].lower() == sender.lower(), f"{leg}: sent by {sender}")
    depth = head - int(receipt["blockNumber"]) + 1
    # Direct mode answers at the shipped depth; facilitator mode takes the facilitator's
    # word (it answers once mined) and watches the block to finality afterwards.
    needed = CONFIRMATIONS if leg == "direct" else 1
    require(depth >= needed, f"{leg}: answered at depth {depth} >= {needed}")
    require(attempt.purchase.offering.slug == SLUG and attempt.amount == PRICE, f"{leg}: booked")
    return {"leg": leg, "attempt": attempt, "tx": settle.transaction, "depth": depth}


def deploy(env: dict[str, str], var: Path, seller: str) -> tuple[str, str]:
    """The release step as a seller runs it: migrate, apply the catalog file, and the
    production checks with the database named (purchases.E001 among them)."""
    manage(env, "migrate", "--noinput")
    applied = manage(env, "offerings", "apply", str(catalog_file(var, seller)), "--by", "ci")
    manage(env, "check", "--deploy", "--database", "default", "--fail-level", "ERROR")
    say("migrated, catalog applied, production checks pass")
    summary = applied.strip().splitlines()[-1][:60]
    return ("production settings, catalog file", f"check --deploy --database passes; {summary}")


def cdp_secret() -> tuple[str, ed25519.Ed25519PublicKey]:
    """A CDP Secret API key of this run, as CDP issues it: base64 of seed + public key."""
    key = ed25519.Ed25519PrivateKey.generate()
    raw = key.private_bytes_raw() + key.public_key().public_bytes_raw()
    return base64.b64encode(raw).decode(), key.public_key()


def direct_leg(env: dict, var: Path, anvil: AnvilNode, chain: dict) -> dict[str, Any]:
    with serving(env, var, "direct") as url:
        say(f"serving (direct mode) at {url}")
        direct = purchase_leg("direct", url, anvil, chain, "Direct")
    say("direct purchase settled")
    direct["proof"] = (
        "stock x402 client, direct",
        f"200; tx {direct['tx'][:18]}… by our relayer, {PRICE} to pay_to, "
        f"depth {direct['depth']} >= {CONFIRMATIONS} at the answer",
    )
    return direct


def facilitator_leg(
    env: dict, var: Path, anvil: AnvilNode, chain: dict, direct: dict
) -> list[tuple[str, str]]:
    """The same deployment settled through the double under CDP's base path with a CDP key
    (X402_BASE_FACILITATOR_URL, X402_BASE_CDP_API_KEY_ID/_SECRET); while it serves, the
    direct purchase is refunded and finality is reached."""
    secret, public = cdp_secret()
    with FacilitatorDouble(anvil.rpc_url, chain["double_relayer"]) as double:
        double.require_cdp_key(CDP_KEY_ID, public)
        facilitated = {
            **env,
            "X402_BASE_FACILITATOR_URL": double.cdp_url,
            "X402_BASE_CDP_API_KEY_ID": CDP_KEY_ID,
            "X402_BASE_CDP_API_KEY_SECRET": secret,
        }
        with serving(facilitated, var, "facilitator") as url:
            say(f"serving (facilitator mode, CDP key) at {url}")
            via = purchase_leg("facilitator", url, anvil, chain, "Facilitated")
            settled_once = not double.refusals and double.calls["settle"] == 1
            require(settled_once, "the double took every JWT of ours and settled once")
            say("facilitated purchase settled")
            proofs = [
                (
                    "stock x402 client, facilitator",
                    f"200; tx {via['tx'][:18]}… by the double's relayer, depth {via['depth']} at "
                    f"the answer (its word), {len(double.tokens)} CDP JWTs taken, 0 refused",
                ),
                refund_leg(anvil, chain, direct["attempt"]),
            ]
            proofs.append(finality_leg(anvil, [direct["attempt"].pk, via["attempt"].pk]))
    return proofs


def main() -> int:
    for name in ("DATABASE_URL", "REDIS_URL"):
        require(os.environ.get(name), f"{name} names the PostgreSQL / Redis server to use")
    db = own_database(os.environ["DATABASE_URL"])
    cache = own_redis(os.environ["REDIS_URL"])
    with (
        tempfile.TemporaryDirectory(prefix="rehearsal-") as tmp,
        AnvilNode(chain_id=8453, block_time=2, accounts=2) as anvil,
    ):
        var = Path(tmp)
        say(f"anvil {anvil.rpc_url}: chain 8453, a block every 2 s")
        chain = chain_up(anvil)
        token = chain["token"]
        proved = [
            (
                "Base's USDC impersonated",
                f"{token['name']!r} v{token['version']} at {BASE_USDC[:10]}…, EIP-712 domain "
                f"{token['domain_separator'][:14]}… read back, minted by its deployer",
            )
        ]
        env = tollbooth_env(chain, anvil.rpc_url, db, cache, var)
        os.environ.update(env)  # this process is finance's shell on the same deployment
        import django

        django.setup()
        proved.append(deploy(env, var, chain["keys"]["seller"].address))
        direct = direct_leg(env, var, anvil, chain)
        proved.append(direct["proof"])
        proved += facilitator_leg(env, var, anvil, chain, direct)
    table(proved)
    return 0


def refund_leg(anvil: AnvilNode, chain: dict, attempt: Any) -> tuple[str, str]:
    """Support proposes, finance approves, finance pays it out from the refund wallet (the
    services the admin's buttons call); the worker broadcasts; the chain shows the money."""
    from core.actors import Actor
    from payments.models import Payout, Refund
    from purchases.services.remedy.case_actions import case_refund_decide, case_refund_propose
    from purchases.services.remedy.payouts import refunds_payout_approve

    buyer = chain["keys"]["buyer"].address
    before = balance(anvil, buyer)
    case_refund_propose(
        purchase_id=attempt.purchase_id, staff="support", kind="refund", note="rehearsal"
    )
    refund = Refund.objects.get(payment_attempt=attempt)
    case_refund_decide(refund_id=refund.pk, approve=True, staff="finance")
    batch = refunds_payout_approve(refund_ids=[refund.pk], actor=Actor.staff("finance"))
    require(batch.payouts and not batch.refused, f"the payout is approved: {batch}")
    payout = wait_until(
        lambda: Payout.objects.filter(refund=refund, state="broadcast").first(),
        "the worker to broadcast the payout",
    )
    wait_until(lambda: _mined(anvil, payout.tx_hash), "the payout to be mined")
    wallet = chain["keys"]["refund_wallet"].address
    transfer_in(anvil, payout.tx_hash, wallet, buyer, PRICE)
    require(balance(anvil, buyer) == before + PRICE, "the buyer has the price back")
    say(f"refund {refund.pk} paid out: {payout.tx_hash}")
    return (
        "refund paid back",
        f"payout tx {payout.tx_hash[:18]}… from the refund wallet, {PRICE} back to the buyer",
    )


def _mined(anvil: AnvilNode, tx_hash: str) -> bool:
    with contextlib.suppress(Exception):
        return anvil.w3().eth.get_transaction_receipt(tx_hash) is not None  # type: ignore[arg-type]
    return False


def finality_leg(anvil: AnvilNode, attempt_ids: list[int]) -> tuple[str, str]:
    """The shipped policy is the node's `finalized` tag, which anvil keeps 64 blocks behind
    its head: mined explicitly (anvil_mine) rather than waited for (~128 s at 2 s blocks).
    Then beat's own jobs (watch-unfinal-settlements, reconcile-payouts, every 30 s) mark both
    settlements final and close the refund on the chain's evidence."""
    from payments.models import PaymentAttempt, Refund

    anvil.rpc("anvil_mine", [hex(FINALIZED_LAG + 1)])
    say(f"mined {FINALIZED_LAG + 1} blocks at once: settlements and payout now finalized")

    def closed() -> bool:
        paid = Refund.objects.filter(state=Refund.State.PAID).exists()
        final = PaymentAttempt.objects.filter(pk__in=attempt_ids, final_at__isnull=False).count()
        return paid and final == len(attempt_ids)

    wait_until(closed, "beat to close the refund and finalize both settlements", timeout=150)
    refund = Refund.objects.get(state=Refund.State.PAID)
    say("beat: both settlements final, refund closed")
    return (
        "finality; refund closed on evidence",
        f"{FINALIZED_LAG + 1} blocks mined explicitly (anvil_mine): both settlements final, "
        f"refund {refund.pk} paid by {refund.paid_by!r} (beat's jobs)",
    )


def table(proved: list[tuple[str, str]]) -> None:
    width = max(len(claim) for claim, _ in proved)
    print("\nREHEARSAL PROVED", flush=True)
    for claim, evidence in proved:
        print(f"  ok  {claim.ljust(width)}  {evidence}", flush=True)
    print(f"REHEARSAL OK in {time.monotonic() - T0:.0f}s", flush=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RehearsalFailed as failed:
        print(f"REHEARSAL FAILED: {failed}", file=sys.stderr, flush=True)
        sys.exit(1)
