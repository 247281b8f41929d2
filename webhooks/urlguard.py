"""The one guard for the URLs Tollbooth POSTs to for others: the endpoints admins keep and
the callback URLs buyers set (docs/webhooks.md, "Where we send"). A buyer chooses its URL,
so a URL is a request to reach inside the seller's network (SSRF) until proved otherwise.

- When a URL is set (`url_check`): http(s) only, https unless REQUIRE_HTTPS is off, a host,
  no user:password, and an IP literal or `localhost` name in a refused range is refused.
- When it is sent to (`guarded_post`): the host is resolved then, every address it resolves
  to must be public (not private, loopback, link-local, multicast, reserved, unspecified;
  an IPv4-mapped IPv6 address is judged as the IPv4 it maps) unless ALLOWED_NETWORKS lists
  it, and the connection goes to the address we checked (no second look-up a rebinding DNS
  could answer differently), TLS still verified against the host's name. No redirect is
  followed, the answer is read to at most `max_bytes`, undecoded, with bounded timeouts.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import SplitResult, urlsplit

import certifi
import urllib3
from django.conf import settings
from urllib3.exceptions import (
    ConnectTimeoutError,
    HTTPError,
    NewConnectionError,
    ReadTimeoutError,
    SSLError,
)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
MAX_URL_LENGTH = 500
# Names that mean this machine whatever DNS says (RFC 6761).
LOOPBACK_NAMES = ("localhost", ".localhost")


class UrlRefused(Exception):
    """A URL we will not POST to. `reason` is stable (an attempt's error, a 400's reason)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@lru_cache(maxsize=8)
def _allowed_networks(
    cidrs: tuple[str, ...],
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(cidr, strict=False) for cidr in cidrs)


def address_refused(address: IPAddress) -> bool:
    """True for an address no webhook may reach (unless ALLOWED_NETWORKS lists it)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    allowed = _allowed_networks(tuple(settings.WEBHOOKS["ALLOWED_NETWORKS"]))
    if any(address.version == net.version and address in net for net in allowed):
        return False
    # is_global is False for private, loopback, link-local, shared (100.64/10), documentation
    # and reserved ranges; multicast is global for some ranges, so it is named too.
    return (
        not address.is_global
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
    )


def url_check(url: str) -> SplitResult:
    """Refuse a URL that is malformed or names a refused address (no DNS here: the guard
    that counts runs at each send). Raises UrlRefused."""
    if not isinstance(url, str) or not url or len(url) > MAX_URL_LENGTH:
        raise UrlRefused("url_malformed", f"A URL of at most {MAX_URL_LENGTH} characters.")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UrlRefused("url_malformed", f"Not a URL: {exc}.") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UrlRefused("url_malformed", "An http(s):// URL with a host.")
    if settings.WEBHOOKS["REQUIRE_HTTPS"] and parts.scheme != "https":
        raise UrlRefused("https_required", "An https:// URL is required.")
    if parts.username is not None or parts.password is not None:
        raise UrlRefused("url_malformed", "No user or password in the URL.")
    if port == 0 or any(c.isspace() for c in url):
        raise UrlRefused("url_malformed", "Not a URL: a port of 0 or whitespace.")
    host = parts.hostname
    literal = _literal(host)
    if literal is None and (host == LOOPBACK_NAMES[0] or host.endswith(LOOPBACK_NAMES[1])):
        literal = ipaddress.ip_address("127.0.0.1")
    if literal is not None and address_refused(literal):
        raise UrlRefused("address_refused", f"{host} is not a public address.")
    return parts


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None


def resolve_public(host: str, port: int) -> IPAddress:
    """The address to connect to: `host` resolved now, refused (UrlRefused) when it does
    not resolve or when any address it resolves to is refused (a name answering one public
    and one private address is refused: which one a client picks is not ours to guess)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise UrlRefused("dns_error", f"{host} does not resolve.") from exc
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
    if not addresses:
        raise UrlRefused("dns_error", f"{host} does not resolve.")
    refused = [a for a in addresses if address_refused(a)]
    if refused:
        raise UrlRefused("address_refused", f"{host} resolves to {refused[0]}, not public.")
    return addresses[0]


@dataclass(frozen=True)
class Answer:
    status: int | None
    excerpt: bytes
    error: str  # "" or a stable reason: timeout, connection_error, tls_error, address_refused...


def guarded_post(
    url: str,
    *,
    body: bytes,
    headers: dict[str, str],
    connect_timeout: float,
    read_timeout: float,
    max_bytes: int,
) -> Answer:
    """POST `body` to `url` through the guard. Never raises for what the far end does."""
    try:
        parts = url_check(url)
        assert parts.hostname is not None  # url_check refuses a URL without one
        port = parts.port or (443 if parts.scheme == "https" else 80)
        address = resolve_public(parts.hostname, port)
    except UrlRefused as refused:
        return Answer(None, b"", refused.reason)
    host_header = parts.netloc.rsplit("@", 1)[-1]
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    pool = _pool(parts.scheme, str(address), port, parts.hostname, connect_timeout, read_timeout)
    try:
        response = pool.urlopen(
            "POST",
            path,
            body=body,
            # identity: what we read is what was sent (no gzip bomb inflating past max_bytes)
            headers={**headers, "Host": host_header, "Accept-Encoding": "identity"},
            redirect=False,
            retries=False,
            preload_content=False,
            assert_same_host=False,
        )
        try:
            excerpt = response.read(max_bytes, decode_content=False) or b""
        finally:
            response.release_conn()
        return Answer(response.status, excerpt[:max_bytes], "")
    except NewConnectionError:  # first: urllib3 makes it a ConnectTimeoutError too
        return Answer(None, b"", "connection_error")
    except (ConnectTimeoutError, ReadTimeoutError, TimeoutError):
        return Answer(None, b"", "timeout")
    except SSLError:
        return Answer(None, b"", "tls_error")
    except (HTTPError, OSError):
        return Answer(None, b"", "connection_error")
    finally:
        pool.close()


def _pool(
    scheme: str, address: str, port: int, hostname: str, connect: float, read: float
) -> urllib3.HTTPConnectionPool:
    timeout = urllib3.Timeout(connect=connect, read=read)
    if scheme == "https":
        # Connect to the checked address; verify the certificate for the URL's host name.
        return urllib3.HTTPSConnectionPool(
            address,
            port,
            timeout=timeout,
            maxsize=1,
            cert_reqs="CERT_REQUIRED",
            ca_certs=certifi.where(),
            server_hostname=hostname,
            assert_hostname=hostname,
        )
    return urllib3.HTTPConnectionPool(address, port, timeout=timeout, maxsize=1)
