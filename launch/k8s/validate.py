"""Offline checks of rendered objects against Kubernetes' own OpenAPI schemas."""

from __future__ import annotations

from typing import Any

import kubernetes_validate

# The oldest Kubernetes the manifests target: NetworkPolicy endPort and policy/v1 need 1.25.
KUBERNETES_VERSION = "1.30.0"


def schema_errors(obj: dict[str, Any], version: str = KUBERNETES_VERSION) -> str | None:
    """Why `obj` is not a valid object of its kind (unknown fields included), or None."""
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as err:
        path = ".".join(str(p) for p in err.path)
        return f"{obj['kind']} {obj['metadata'].get('name')}: {path}: {err.message}"
    return None
