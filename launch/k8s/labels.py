"""The metadata and labels every rendered object shares: the workloads and the NetworkPolicies
select pods by the same labels."""

from __future__ import annotations

from typing import Any

from pdd.launch.k8s.spec import Spec, Tier

Obj = dict[str, Any]


def meta(spec: Spec, name: str, namespace: str, role: str) -> Obj:
    labels = {"app.kubernetes.io/name": spec.name, "app.kubernetes.io/component": role}
    return {"name": name, "namespace": namespace, "labels": labels}


def selector(spec: Spec, role: str, instance: str | None = None) -> dict[str, str]:
    sel = {"app.kubernetes.io/name": spec.name, "app.kubernetes.io/component": role}
    return sel | ({"pdd.dev/instance": instance} if instance else {})


def instance_name(spec: Spec, tier: Tier, i: int) -> str:
    """Instance i's StatefulSet and Service, and its pods' `pdd.dev/instance` label."""
    return f"{spec.name}-{tier.role}-{i}"
