"""The bench's settings: production's, serving the bench-only anchor URLs (bench/urls.py).

Production on purpose (DEBUG off, persistent connections with health checks, throttles and
middleware as deployed): the figures compare the API as it is served against anchors
served by the same process. `bench/run.py` supplies the environment a deployment would
(secret key, hosts, metrics token, a throttle rate the load cannot reach).
"""

from config.settings.production import *  # noqa: F403

ROOT_URLCONF = "bench.urls"
X402_REFUSE_LOCAL_NETWORKS = False  # the bench sells on anvil on purpose

# bench/webhooks_load.py's receivers listen on loopback over plain http.
WEBHOOKS = {**WEBHOOKS, "REQUIRE_HTTPS": False, "ALLOWED_NETWORKS": ["127.0.0.0/8"]}  # noqa: F405
