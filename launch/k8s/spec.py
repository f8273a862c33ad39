"""The deployment spec: one YAML file describing both datacenters, checked field by field.

Every refusal names the field (`prefill.tp`, `main.wan_addresses`, ...), so a wrong spec is
fixed from the message alone. `launch/k8s/example.yaml` shows every field.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

TIERS = ("prefill", "relay", "main")
TRANSFER_BACKENDS = ("mooncake_tcp", "mooncake")
DEFAULT_PORTS = {"prefill": 30000, "relay": 30001, "main": 30002}
# Where the kernel puts sockets bound to port 0 (SGLang's KV-transfer ZMQ sockets): Linux's
# default, set on every server pod so that the NetworkPolicies can name it.
EPHEMERAL_PORTS = (32768, 60999)
# Mooncake's default range for its handshake and TCP data ports; it takes a range only when
# both ends lie in 1024-65535 and outside EPHEMERAL_PORTS (else it falls back to this one).
MOONCAKE_PORTS = (15000, 17000)
# The pod environment the render sets itself: a tier's `env` must not change it.
RENDERED_ENV = ("SGLANG_HOST_IP", "MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT")


class SpecError(ValueError):
    """A spec field is missing or wrong; the message starts with the field's name."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


@dataclass(frozen=True)
class Datacenter:
    name: str
    namespace: str
    # Where this datacenter's traffic comes from as the other one sees it (node or egress
    # addresses): the NetworkPolicies admit pods of another datacenter from these.
    egress_cidrs: tuple[str, ...]


@dataclass(frozen=True)
class Tier:
    """One PDD tier: `count` SGLang servers of `tp` chips each, all in one datacenter."""

    role: str  # prefill, relay or main
    datacenter: str
    count: int
    tp: int
    chips_per_node: int
    chip_resource: str
    port: int
    bootstrap_port: int | None  # P only
    control_port: int | None  # MD only
    # Per instance, the address the other datacenter reaches it at (empty: in-cluster DNS).
    wan_addresses: tuple[str, ...]
    extra_args: tuple[str, ...]
    # Which nodes carry this tier's chips (e.g. a GPU product label), and extra environment
    # (NCCL or Mooncake settings, say).
    node_selector: dict[str, str]
    env: dict[str, str]

    @property
    def nodes(self) -> int:
        """Nodes one instance spans: TP beyond one node is SGLang's multi-node mode."""
        return max(1, self.tp // self.chips_per_node)

    @property
    def chips_per_pod(self) -> int:
        return min(self.tp, self.chips_per_node)


@dataclass(frozen=True)
class Router:
    datacenter: str
    replicas: int
    port: int
    control_port: int
    # Who may reach `port` (empty: anyone, as the routers serve the clients there).
    client_cidrs: tuple[str, ...]
    extra_args: tuple[str, ...]


@dataclass(frozen=True)
class Spec:
    name: str
    image: str
    model_path: str
    model_volume: dict[str, Any]  # a Kubernetes volume source holding model_path
    served_model_name: str
    secret: bytes
    control_encrypt: bool  # CURVE on the control plane, keys derived from `secret`
    transfer_backend: str
    dist_init_port: int
    # First and last port Mooncake's engines listen on (its handshake and TCP data ports).
    mooncake_ports: tuple[int, int]
    datacenters: dict[str, Datacenter]
    tiers: dict[str, Tier]
    router: Router


def _get(doc: dict[str, Any], key: str, where: str, kind: type, default: Any = None) -> Any:
    field = f"{where}.{key}" if where else key
    value = doc.get(key, default)
    if value is None:
        raise SpecError(field, "is required")
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise SpecError(field, f"must be a {kind.__name__}, got {value!r}")
    if kind is str and not value:
        raise SpecError(field, "must not be empty")
    return value


def _port(doc: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    port: int = _get(doc, key, where, int, default)
    if not 0 < port < 65536:
        raise SpecError(f"{where}.{key}", f"must be in 1-65535, got {port}")
    return port


def _positive(doc: dict[str, Any], key: str, where: str, default: int) -> int:
    value: int = _get(doc, key, where, int, default)
    if value < 1:
        raise SpecError(f"{where}.{key}", f"must be at least 1, got {value}")
    return value


def _strings(doc: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = doc.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise SpecError(f"{where}.{key}", "must be a list of non-empty strings")
    return tuple(value)


def _cidrs(doc: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    cidrs = _strings(doc, key, where)
    for cidr in cidrs:
        try:
            ipaddress.ip_network(cidr)
        except ValueError as err:
            raise SpecError(f"{where}.{key}", str(err)) from None
    return cidrs


def _datacenter(name: str, doc: Any) -> Datacenter:
    where = f"datacenters.{name}"
    if not isinstance(doc, dict):
        raise SpecError(where, "must be a mapping")
    cidrs = _cidrs(doc, "egress_cidrs", where)
    return Datacenter(name, _get(doc, "namespace", where, str, "pdd"), cidrs)


def _tier(role: str, doc: Any, datacenters: dict[str, Datacenter]) -> Tier:
    if not isinstance(doc, dict):
        raise SpecError(role, "must be a mapping")
    dc = _get(doc, "datacenter", role, str)
    if dc not in datacenters:
        raise SpecError(
            f"{role}.datacenter", f"{dc!r} is not one of datacenters {list(datacenters)}"
        )
    tp = _positive(doc, "tp", role, 1)
    chips = _positive(doc, "chips_per_node", role, 8)
    if tp % chips and chips % tp:
        raise SpecError(
            f"{role}.tp",
            f"{tp} chips neither divide a node's {chips} (chips_per_node) nor fill whole nodes",
        )
    count = _positive(doc, "count", role, 1)
    wan = _strings(doc, "wan_addresses", role)
    if wan and len(wan) != count:
        raise SpecError(f"{role}.wan_addresses", f"needs one address per instance ({count})")
    return Tier(
        role=role,
        datacenter=dc,
        count=count,
        tp=tp,
        chips_per_node=chips,
        chip_resource=_get(doc, "chip_resource", role, str, "nvidia.com/gpu"),
        port=_port(doc, "port", role, DEFAULT_PORTS[role]),
        bootstrap_port=_port(doc, "bootstrap_port", role, 8998) if role == "prefill" else None,
        control_port=_port(doc, "control_port", role) if role == "main" else None,
        wan_addresses=wan,
        extra_args=_strings(doc, "extra_args", role),
        node_selector=_string_map(doc, "node_selector", role),
        env=_env(doc, role),
    )


def _env(doc: dict[str, Any], role: str) -> dict[str, str]:
    env = _string_map(doc, "env", role)
    for key in RENDERED_ENV:
        if key in env:
            raise SpecError(
                f"{role}.env", f"{key} is set by the render (the pod's IP, mooncake_ports)"
            )
    return env


def _string_map(doc: dict[str, Any], key: str, where: str) -> dict[str, str]:
    value = doc.get(key, {})
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise SpecError(f"{where}.{key}", "must map strings to strings (quote numbers)")
    return dict(value)


def _secret(doc: dict[str, Any], base: Path) -> bytes:
    ref = doc.get("secret")
    if not isinstance(ref, dict) or not isinstance(ref.get("file"), str):
        raise SpecError(
            "secret.file",
            "MD's control socket faces the WAN and needs the control-plane secret: a file "
            "(`openssl rand -hex 32`), relative to the spec",
        )
    path = base / ref["file"]
    try:
        value = path.read_bytes().strip()
    except OSError as err:
        raise SpecError("secret.file", f"cannot read {path}: {err.strerror}") from None
    if len(value) < 16:
        raise SpecError("secret.file", f"{path} holds under 16 bytes: too easy to guess")
    return value


def _check_reachable(spec: Spec) -> None:
    """Traffic that crosses datacenters needs an address the other side can reach."""
    p, router = spec.tiers["prefill"], spec.router
    for tier in spec.tiers.values():
        if tier.datacenter != router.datacenter and not tier.wan_addresses:
            raise SpecError(f"{tier.role}.wan_addresses", "routers reach it across the WAN")
        if tier.datacenter != p.datacenter and not p.wan_addresses:
            raise SpecError("prefill.wan_addresses", f"{tier.role} fetches KV across the WAN")
    # Each tier talks to every other in both directions (requests, KV, its acknowledgements), so
    # once the pods span datacenters each of them is a source the other admits.
    used = {router.datacenter} | {tier.datacenter for tier in spec.tiers.values()}
    for dc in spec.datacenters.values():
        if len(used) > 1 and dc.name in used and not dc.egress_cidrs:
            raise SpecError(
                f"datacenters.{dc.name}.egress_cidrs",
                "the NetworkPolicies admit this datacenter's pods elsewhere only from these",
            )


def _mooncake_ports(doc: dict[str, Any], tiers: dict[str, Tier]) -> tuple[int, int]:
    where = "mooncake_ports"
    given = doc.get(where, {})
    if not isinstance(given, dict):
        raise SpecError(where, "must be a mapping: min, max")
    low = _port(given, "min", where, MOONCAKE_PORTS[0])
    high = _port(given, "max", where, MOONCAKE_PORTS[1])
    if low < 1024 or low > high or (high >= EPHEMERAL_PORTS[0] and low <= EPHEMERAL_PORTS[1]):
        raise SpecError(
            where,
            f"{low}-{high} must lie in 1024-65535, clear of the ephemeral ports "
            f"{EPHEMERAL_PORTS[0]}-{EPHEMERAL_PORTS[1]} the ZMQ sockets take (Mooncake ignores "
            "a range with an end among them)",
        )
    # Every chip of a pod runs an engine with a handshake and a TCP data port.
    need = 2 * max(tier.chips_per_pod for tier in tiers.values())
    if high - low + 1 < need:
        raise SpecError(where, f"{low}-{high} holds under {need} ports, two per chip of a pod")
    return low, high


def _check_ports(spec: Spec) -> None:
    """One port per purpose: tiers may share a node (or the host network), so no two collide."""
    seen: dict[int, str] = {}
    ports = [("router.port", spec.router.port), ("router.control_port", spec.router.control_port)]
    ports.append(("dist_init_port", spec.dist_init_port))
    for tier in spec.tiers.values():
        ports.append((f"{tier.role}.port", tier.port))
        if tier.bootstrap_port is not None:
            ports.append((f"{tier.role}.bootstrap_port", tier.bootstrap_port))
        if tier.control_port is not None:
            ports.append((f"{tier.role}.control_port", tier.control_port))
    low, high = spec.mooncake_ports
    for field, port in ports:
        if port in seen:
            raise SpecError(field, f"port {port} is already {seen[port]}'s")
        if low <= port <= high:
            raise SpecError(field, f"port {port} is in mooncake_ports ({low}-{high})")
        seen[port] = field


def parse_spec(doc: Any, base: Path = Path(".")) -> Spec:
    """A checked Spec from a parsed YAML document; `base` resolves relative file names."""
    if not isinstance(doc, dict):
        raise SpecError("spec", "must be a mapping")
    model = doc.get("model")
    if not isinstance(model, dict):
        raise SpecError("model", "is required: path (inside the image or volume) and volume")
    dcs = doc.get("datacenters")
    if not isinstance(dcs, dict) or not dcs:
        raise SpecError("datacenters", "is required: a mapping of datacenter names")
    datacenters = {str(n): _datacenter(str(n), d) for n, d in dcs.items()}
    for role in TIERS:
        if role not in doc:
            raise SpecError(role, "is required")
    tiers = {role: _tier(role, doc[role], datacenters) for role in TIERS}
    router_doc = doc.get("router") or {}
    rdc = _get(router_doc, "datacenter", "router", str, tiers["prefill"].datacenter)
    if rdc not in datacenters:
        raise SpecError("router.datacenter", f"{rdc!r} is not one of {list(datacenters)}")
    volume = _get(model, "volume", "model", dict)
    model_path = _get(model, "path", "model", str)
    backend = _get(doc, "transfer_backend", "", str, "mooncake_tcp")
    if backend not in TRANSFER_BACKENDS:
        raise SpecError("transfer_backend", f"must be one of {TRANSFER_BACKENDS}")
    spec = Spec(
        name=_get(doc, "name", "", str, "pdd"),
        image=_get(doc, "image", "", str),
        model_path=model_path,
        model_volume=volume,
        served_model_name=_get(model, "served_name", "model", str, Path(model_path).name),
        secret=_secret(doc, base),
        control_encrypt=_get(doc["secret"], "encrypt", "secret", bool, False),
        transfer_backend=backend,
        dist_init_port=_port(doc, "dist_init_port", "", 5000),
        mooncake_ports=_mooncake_ports(doc, tiers),
        datacenters=datacenters,
        tiers=tiers,
        router=Router(
            datacenter=rdc,
            replicas=_positive(router_doc, "replicas", "router", 2),
            port=_port(router_doc, "port", "router", 8000),
            control_port=_port(router_doc, "control_port", "router", 7600),
            client_cidrs=_cidrs(router_doc, "client_cidrs", "router"),
            extra_args=_strings(router_doc, "extra_args", "router"),
        ),
    )
    _check_reachable(spec)
    _check_ports(spec)
    return spec


def load_spec(path: Path) -> Spec:
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise SpecError("spec", f"{path} is not YAML: {err}") from None
    return parse_spec(doc, path.parent)
