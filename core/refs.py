"""Public references: agents never see integer primary keys."""

import secrets


def new_ref(prefix: str) -> str:
    # 20 random bytes in base32-ish text: unguessable, URL-safe, sortable enough for humans.
    return f"{prefix}_{secrets.token_urlsafe(15).replace('-', 'x').replace('_', 'y')}"
