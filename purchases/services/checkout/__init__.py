"""The authorize-and-verify boundary: a payment id claimed and leased, a quote paid on any
rail (the one orchestration), the duplicate window."""
