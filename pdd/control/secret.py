"""The control plane's shared secret (HMAC key), as MD and the router both read it."""

from __future__ import annotations

import os
from pathlib import Path

ENV_SECRET = "PDD_CONTROL_SECRET"


def read_secret(path: str | Path | None) -> bytes | None:
    """The secret from `path`, else from $PDD_CONTROL_SECRET; None: messages are not signed.
    An empty file is an error: it would silently turn authentication off."""
    if path is not None:
        secret = Path(path).read_bytes().strip()
        if not secret:
            raise ValueError(f"secret file {path} is empty")
        return secret
    env = os.environ.get(ENV_SECRET)
    return env.encode() if env else None
