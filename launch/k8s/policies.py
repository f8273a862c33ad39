"""NetworkPolicies: every port a pdd pod listens on admits only the pods that connect to it.

Who connects to what (SGLang 0.5.23's Mooncake connector, Mooncake's P2P handshake mode):
- P's HTTP port: the routers; the decoders too, as SGLang re-runs a retracted request's prefill
  there (`/generate` on P's host and HTTP port).
- P's bootstrap port: the decoders (`/route` to find P's ranks, `/health` as a heartbeat). P's
  own ranks register there from their own pod, or from pod 0's peers in a multi-node instance.
- Each TP rank's ZMQ socket (a kernel-chosen port, in spec.EPHEMERAL_PORTS): the decoders send
  P the destination of each request's KV and their aborts; P sends the decoders each
  transfer's status, aux data and abort acknowledgements.
- Mooncake's handshake and TCP data ports (spec.mooncake_ports): P writes into the decoders'
  memory, so P connects to theirs; no one connects to P's (its own engines only initiate).
- MD's control port: the routers. The routers' control port: MD (READY, ACK).
- The routers' HTTP port: the clients, from anywhere unless `router.client_cidrs` says.
- The nodes of a multi-node instance reach each other on any port (NCCL, Gloo, SGLang's
  dist-init and its bootstrap registration).
A pod in the same datacenter is admitted by its labels, one in another datacenter by that
datacenter's `egress_cidrs`. Traffic from a pod's own node (the kubelet's probes) and from the
pod itself is always allowed by Kubernetes.
"""

from __future__ import annotations

from pdd.launch.k8s.labels import Obj, instance_name, meta, selector
from pdd.launch.k8s.spec import EPHEMERAL_PORTS, Spec, Tier


def _datacenter(spec: Spec, role: str) -> str:
    return spec.router.datacenter if role == "router" else spec.tiers[role].datacenter


def _peers(spec: Spec, roles: tuple[str, ...], dc: str) -> list[Obj]:
    """The pods of `roles` as a policy in datacenter `dc` can name them."""
    out: list[Obj] = []
    for role in roles:
        home = _datacenter(spec, role)
        if home == dc:
            named = [{"podSelector": {"matchLabels": selector(spec, role)}}]
        else:
            named = [{"ipBlock": {"cidr": c}} for c in spec.datacenters[home].egress_cidrs]
        out += [peer for peer in named if peer not in out]  # roles sharing a datacenter
    return out


def _tcp(first: int, last: int | None = None) -> Obj:
    port: Obj = {"protocol": "TCP", "port": first}
    return port | ({"endPort": last} if last is not None and last > first else {})


def _policy(spec: Spec, name: str, role: str, pods: dict[str, str], rules: list[Obj]) -> Obj:
    namespace = spec.datacenters[_datacenter(spec, role)].namespace
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(spec, name, namespace, role),
        "spec": {
            "podSelector": {"matchLabels": pods},
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }


def _server_rules(spec: Spec, tier: Tier) -> list[Obj]:
    dc, decoders, ephemeral = tier.datacenter, ("relay", "main"), _tcp(*EPHEMERAL_PORTS)
    routers = _peers(spec, ("router",), dc)
    if tier.role == "prefill":
        assert tier.bootstrap_port is not None
        return [
            {"from": _peers(spec, ("router", *decoders), dc), "ports": [_tcp(tier.port)]},
            {"from": _peers(spec, decoders, dc), "ports": [_tcp(tier.bootstrap_port), ephemeral]},
        ]
    rules = [
        {"from": routers, "ports": [_tcp(tier.port)]},
        {"from": _peers(spec, ("prefill",), dc), "ports": [ephemeral, _tcp(*spec.mooncake_ports)]},
    ]
    if tier.control_port is not None:
        rules.append({"from": routers, "ports": [_tcp(tier.control_port)]})
    return rules


def _router_rules(spec: Spec) -> list[Obj]:
    r = spec.router
    clients: Obj = {"ports": [_tcp(r.port)]}
    if r.client_cidrs:
        clients["from"] = [{"ipBlock": {"cidr": c}} for c in r.client_cidrs]
    return [
        clients,
        {"from": _peers(spec, ("main",), r.datacenter), "ports": [_tcp(r.control_port)]},
    ]


def policies(spec: Spec) -> list[tuple[str, Obj]]:
    """Every NetworkPolicy, with the datacenter it belongs in."""
    out = []
    for tier in spec.tiers.values():
        name, pods = f"{spec.name}-{tier.role}", selector(spec, tier.role)
        out.append(
            (tier.datacenter, _policy(spec, name, tier.role, pods, _server_rules(spec, tier)))
        )
        for i in range(tier.count if tier.nodes > 1 else 0):
            # Adds to the policy above: the instance's own pods, on every port and protocol.
            instance = instance_name(spec, tier, i)
            nodes = selector(spec, tier.role, instance)
            rule = {"from": [{"podSelector": {"matchLabels": nodes}}]}
            policy = _policy(spec, f"{instance}-nodes", tier.role, nodes, [rule])
            out.append((tier.datacenter, policy))
    routers = _policy(
        spec, f"{spec.name}-router", "router", selector(spec, "router"), _router_rules(spec)
    )
    return out + [(spec.router.datacenter, routers)]
