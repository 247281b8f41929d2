"""The quote boundary: what is sold (offerings, their terms and stock) and the quote that
freezes those terms for one input."""
