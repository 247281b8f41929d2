// SPDX-License-Identifier: MIT
pragma solidity ^0.8.20;

/// @title X402UptoPermit2Proxy
/// @notice The x402 `upto` settlement proxy for local chains, written to the ABI the x402 SDKs
/// call (`settle`): the buyer's Permit2 signature names this contract as spender and binds, in
/// its witness, the payee, the one facilitator allowed to settle and the start of the window;
/// the facilitator picks the amount, at most the signed ceiling. Placed at the SDK's canonical
/// address with `anvil_setCode`, so it keeps no storage and no immutables (docs/chain.md).
contract X402UptoPermit2Proxy {
    struct TokenPermissions { address token; uint256 amount; }
    struct PermitTransferFrom { TokenPermissions permitted; uint256 nonce; uint256 deadline; }
    struct SignatureTransferDetails { address to; uint256 requestedAmount; }
    struct Witness { address to; address facilitator; uint256 validAfter; }

    address public constant PERMIT2 = 0x000000000022D473030F116dDEE9F6B43aC78BA3;
    bytes32 public constant WITNESS_TYPEHASH =
        keccak256("Witness(address to,address facilitator,uint256 validAfter)");
    // Permit2 appends this to "PermitWitnessTransferFrom(...,uint256 deadline,": the witness
    // field, then the referenced types in alphabetical order, as EIP-712 encodes them.
    string public constant WITNESS_TYPE_STRING =
        "Witness witness)TokenPermissions(address token,uint256 amount)Witness(address to,address facilitator,uint256 validAfter)";

    // The names the SDK maps revert reasons from.
    error AmountExceedsPermitted();
    error UnauthorizedFacilitator();
    error PaymentTooEarly();
    error InvalidDestination();
    error InvalidOwner();

    function settle(
        PermitTransferFrom calldata permit,
        uint256 amount,
        address owner,
        Witness calldata witness,
        bytes calldata signature
    ) external {
        if (amount > permit.permitted.amount) revert AmountExceedsPermitted();
        // Only the facilitator the buyer signed for may choose the amount.
        if (msg.sender != witness.facilitator) revert UnauthorizedFacilitator();
        if (block.timestamp < witness.validAfter) revert PaymentTooEarly();
        if (witness.to == address(0)) revert InvalidDestination();
        if (owner == address(0)) revert InvalidOwner();
        // Permit2 checks the signature (over this witness), the deadline and the nonce, spends
        // the nonce, and moves `amount` from the owner to witness.to.
        IPermit2(PERMIT2).permitWitnessTransferFrom(
            permit,
            SignatureTransferDetails(witness.to, amount),
            owner,
            keccak256(abi.encode(WITNESS_TYPEHASH, witness)),
            WITNESS_TYPE_STRING,
            signature
        );
    }
}

interface IPermit2 {
    function permitWitnessTransferFrom(
        X402UptoPermit2Proxy.PermitTransferFrom calldata permit,
        X402UptoPermit2Proxy.SignatureTransferDetails calldata transferDetails,
        address owner,
        bytes32 witness,
        string calldata witnessTypeString,
        bytes calldata signature
    ) external;
}
