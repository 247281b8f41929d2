"""Offerings as code: the whole catalog as one reviewable YAML file (docs/offerings-as-code.md).

`document` reads a file (every value with its line), `checks` validates it as the admin
would, `apply` makes the catalog equal to it through the admin's services, `export` writes
the catalog as such a file and `openapi` drafts one from a seller's OpenAPI 3 document.
"""
