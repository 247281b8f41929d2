#!/usr/bin/env node
// Compiles contracts/TestUSDC.sol with the npm solc package (offline) and writes the
// artifact the Python side loads: payments/chain/artifacts/TestUSDC.json.
// The artifact is committed so tests and the demo need no compiler.
// Usage: node scripts/compile_contracts.js
"use strict";

const crypto = require("crypto");
const fs = require("fs");
const path = require("path");
const solc = require("solc");

const ROOT = path.resolve(__dirname, "..");
const CONTRACT = "TestUSDC";
const SOURCE_REL = "contracts/TestUSDC.sol";
const OUT = path.join(ROOT, "payments", "chain", "artifacts", `${CONTRACT}.json`);

// Pinned settings: the same source and compiler always give the same bytes.
// "cancun" runs on anvil and on current L2s; the key is a relative path so the metadata
// (and so the bytecode) does not depend on where the checkout lives.
const SETTINGS = {
  optimizer: { enabled: true, runs: 200 },
  evmVersion: "cancun",
  outputSelection: { "*": { "*": ["abi", "evm.bytecode.object"] } },
};

function main() {
  const source = fs.readFileSync(path.join(ROOT, SOURCE_REL), "utf8");
  const input = {
    language: "Solidity",
    sources: { [SOURCE_REL]: { content: source } },
    settings: SETTINGS,
  };
  const output = JSON.parse(solc.compile(JSON.stringify(input)));

  let failed = false;
  for (const diag of output.errors || []) {
    process.stderr.write(diag.formattedMessage || diag.message);
    if (diag.severity === "error") failed = true;
  }
  if (failed) process.exit(1);

  const compiled = output.contracts[SOURCE_REL][CONTRACT];
  const artifact = {
    contractName: CONTRACT,
    abi: compiled.abi,
    bytecode: "0x" + compiled.evm.bytecode.object,
    compiler: {
      name: "solc-js",
      version: solc.version(),
      settings: { optimizer: SETTINGS.optimizer, evmVersion: SETTINGS.evmVersion },
      source: SOURCE_REL,
      // Lets a test tell a stale artifact from a fresh one without a compiler.
      sourceSha256: crypto.createHash("sha256").update(source, "utf8").digest("hex"),
    },
  };

  fs.mkdirSync(path.dirname(OUT), { recursive: true });
  fs.writeFileSync(OUT, JSON.stringify(artifact, null, 2) + "\n");
  process.stdout.write(`wrote ${path.relative(ROOT, OUT)} (solc ${solc.version()})\n`);
}

main();
