// Buy from a Tollbooth paid URL with the official x402 TypeScript client, unmodified.
//
//   node docs/examples/x402-buy.mjs URL '{"title": "Sales", "csv": "a,b\n1,2\n"}'
//
// Environment: BUYER_KEY (0x private key), TOKEN and NETWORK (the asset and CAIP-2 network
// from the 402), TIMEOUT (seconds). Prints what the caller got as one JSON line. The tests
// run this file as it is (tests/x402/test_stock_clients.py).
import { wrapFetchWithPayment, x402Client } from "@x402/fetch";
import { registerExactEvmScheme } from "@x402/evm/exact/client";
import { privateKeyToAccount } from "viem/accounts";

const [url, body] = process.argv.slice(2);
const { BUYER_KEY, TOKEN, NETWORK, TIMEOUT = "30" } = process.env;

const client = new x402Client();
registerExactEvmScheme(client, { signer: privateKeyToAccount(BUYER_KEY) });
// The client pays well-known USDC addresses only; a local test token must be allowed.
client.setSpendControls({ allowedAssets: [{ network: NETWORK, asset: TOKEN }] });
const fetchWithPayment = wrapFetchWithPayment(fetch, client);

try {
  const response = await fetchWithPayment(url, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body,
    signal: AbortSignal.timeout(Number(TIMEOUT) * 1000),
  });
  const headers = Object.fromEntries(response.headers.entries());
  console.log(JSON.stringify({ outcome: "response", status: response.status, headers, body: await response.text() }));
} catch (error) {
  if (error.name !== "TimeoutError" && error.cause?.name !== "TimeoutError") throw error;
  console.log(JSON.stringify({ outcome: "timeout" }));
}
