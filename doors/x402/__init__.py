"""The x402 paid URL: `views` (the paid URL and its discovery, thin), `answers` (a domain
result as an x402 HTTP response) and `paid_async` (the paid URL on the ASGI event loop). Its
domain is purchases.services.x402; the rail is payments.rails.x402."""
