"""The kernel every app may use and that uses none of them."""
