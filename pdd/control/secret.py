"""The control plane's shared secret (HMAC key), as MD and the router both read it."""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import stat
from pathlib import Path

logger = logging.getLogger(__name__)

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


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a socket to this machine ("localhost" or a loopback IP)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, or a wildcard such as "*"
        return False


def bind_problem(host: str, secret: bytes | None, insecure: bool, flags: tuple[str, str]) -> str:
    """Why a control socket must not bind `host`, or "": anyone who reaches an unauthenticated
    one can send handoffs and cancels. `flags` names the secret's flag and the insecure one."""
    if secret is not None or is_loopback(host):
        return ""
    secret_flag, insecure_flag = flags
    if insecure:
        logger.warning("control socket on %s without a secret (%s): anyone who reaches it can "
                       "steer requests", host, insecure_flag)  # fmt: skip
        return ""
    return (
        f"the control socket binds {host}, beyond this machine, without a secret: give "
        f"{secret_flag} (or ${ENV_SECRET}), or {insecure_flag} to run it unauthenticated"
    )


def warn_if_readable(path: str | Path | None) -> None:
    """A secret others can read is no secret: say so (the file is still used)."""
    if path is None:
        return
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("secret file %s is readable by others (mode %o): chmod 600 it",
                       path, stat.S_IMODE(mode))  # fmt: skip


def write_secret(path: Path) -> Path:
    """A fresh random secret at `path`, readable only by its owner (kept if it exists)."""
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path
