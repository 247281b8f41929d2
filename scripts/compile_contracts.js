#!/usr/bin/env node
// Compiles the contracts in contracts/ with the npm solc package (offline) and writes the
// artifacts the Python side loads: payments/chain/artifacts/TestUSDC.json and
// devtools/artifacts/X402UptoPermit2Proxy.json.
// The artifacts are committed so tests and the demo need no compiler.
// Usage: node scripts/compile_contracts.js
"use strict";

const crypto = require("crypto");
const fs = require("fs");
const path = require("path");
const solc = require("solc");

const ROOT = path.resolve(__dirname, "..");
// `runtime`: the proxy is placed with anvil_setCode, which takes the deployed (runtime)
// code, not the creation code.
const CONTRACTS = [
  { name: "TestUSDC", source: "contracts/TestUSDC.sol", out: "payments/chain/artifacts" },
  {
    name: "X402UptoPermit2Proxy",
    source: "contracts/X402UptoPermit2Proxy.sol",
    out: "devtools/artifacts",
    runtime: true,
  },
];

// Pinned settings: the same source and compiler always give the same bytes.
// "cancun" runs on anvil and on current L2s; the key is a relative path so the metadata
// (and so the bytecode) does not depend on where the checkout lives.
const SETTINGS = {
  optimizer: { enabled: true, runs: 200 },
  evmVersion: "cancun",
};

function compile(contract) {
  const source = fs.readFileSync(path.join(ROOT, contract.source), "utf8");
  const outputs = ["abi", "evm.bytecode.object"];
  if (contract.runtime) outputs.push("evm.deployedBytecode.object");
  // One compilation per source, so adding a contract never changes another's metadata.
  const input = {
    language: "Solidity",
    sources: { [contract.source]: { content: source } },
    settings: { ...SETTINGS, outputSelection: { "*": { "*": outputs } } },
  };
  const output = JSON.parse(solc.compile(JSON.stringify(input)));

  let failed = false;
  for (const diag of output.errors || []) {
    process.stderr.write(diag.formattedMessage || diag.message);
    if (diag.severity === "error") failed = true;
  }
  if (failed) process.exit(1);

  const compiled = output.contracts[contract.source][contract.name];
  const artifact = {
    contractName: contract.name,
    abi: compiled.abi,
    bytecode: "0x" + compiled.evm.bytecode.object,
  };
  if (contract.runtime) artifact.deployedBytecode = "0x" + compiled.evm.deployedBytecode.object;
  artifact.compiler = {
    name: "solc-js",
    version: solc.version(),
    settings: SETTINGS,
    source: contract.source,
    // Lets a test tell a stale artifact from a fresh one without a compiler.
    sourceSha256: crypto.createHash("sha256").update(source, "utf8").digest("hex"),
  };

  const out = path.join(ROOT, contract.out, `${contract.name}.json`);
  fs.mkdirSync(path.dirname(out), { recursive: true });
  fs.writeFileSync(out, JSON.stringify(artifact, null, 2) + "\n");
  process.stdout.write(`wrote ${path.relative(ROOT, out)} (solc ${solc.version()})\n`);
}

CONTRACTS.forEach(compile);
