"""Kubernetes objects for one PDD deployment, per datacenter, from a checked Spec.

Each SGLang instance is a StatefulSet (one pod per node it spans) with a headless Service for
the pods' DNS (SGLang's `--dist-init-addr` is pod 0's) and a Service that reaches pod 0 alone,
where SGLang serves HTTP. Pods advertise their pod IP to Mooncake (`SGLANG_HOST_IP`), so KV
flows pod to pod: P's and MD's pod IPs must be routable between the datacenters (a flat
network, a cluster mesh, or `hostNetwork` added by hand). The routers are a Deployment; each
advertises its own pod IP as the address MD sends READY and ACK to. NetworkPolicies
(`policies.py`) admit on each port only the pods that connect to it.
"""

from __future__ import annotations

import base64
import shlex

from pdd.launch.k8s.labels import Obj, instance_name, meta, selector
from pdd.launch.k8s.policies import policies
from pdd.launch.k8s.spec import EPHEMERAL_PORTS, Spec, Tier

SECRET_DIR = "/etc/pdd"
SECRET_KEY = "control.secret"
MODEL_DIR = "/models"
# A first load of a large model (weights from a network volume) can take many minutes.
STARTUP_S = 1800
PROBE_PERIOD_S = 10
NODE_RANK = "<node rank>"  # in a pod's command line: its ordinal, which the shell substitutes


def instance_url(spec: Spec, tier: Tier, i: int, from_dc: str) -> str:
    """How a pod in `from_dc` reaches instance i's HTTP port. P's URL host is also the bootstrap
    host its decoders connect to, so P's WAN address is used wherever it has one."""
    wan = tier.datacenter != from_dc or tier.role == "prefill"
    if wan and tier.wan_addresses:
        return f"http://{tier.wan_addresses[i]}:{tier.port}"
    ns = spec.datacenters[tier.datacenter].namespace
    return f"http://{instance_name(spec, tier, i)}.{ns}.svc:{tier.port}"


def _secret(spec: Spec, namespace: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta(spec, f"{spec.name}-control", namespace, "control-secret"),
        "type": "Opaque",
        "data": {SECRET_KEY: base64.b64encode(spec.secret).decode()},
    }


def _secret_volume(spec: Spec) -> tuple[Obj, Obj]:
    volume = {
        "name": "control-secret",
        "secret": {"secretName": f"{spec.name}-control", "defaultMode": 0o400},
    }
    return volume, {"name": "control-secret", "mountPath": SECRET_DIR, "readOnly": True}


def _server_args(spec: Spec, tier: Tier, name: str, ns: str) -> list[str]:
    args = [
        "python3", "-m", "sglang.launch_server",
        "--model-path", spec.model_path,
        "--served-model-name", spec.served_model_name,
        "--host", "0.0.0.0",
        "--port", str(tier.port),
        "--tp-size", str(tier.tp),
        "--pdd-role", tier.role,
        "--disaggregation-mode", "prefill" if tier.role == "prefill" else "decode",
        "--disaggregation-transfer-backend", spec.transfer_backend,
    ]  # fmt: skip
    if tier.bootstrap_port is not None:
        args += ["--disaggregation-bootstrap-port", str(tier.bootstrap_port)]
    if tier.control_port is not None:
        args += ["--pdd-control-port", str(tier.control_port)]
        args += ["--pdd-secret-file", f"{SECRET_DIR}/{SECRET_KEY}"]
        args += ["--pdd-control-encrypt"] if spec.control_encrypt else []
    if tier.nodes > 1:
        dist = f"{name}-0.{name}-nodes.{ns}.svc:{spec.dist_init_port}"
        args += ["--nnodes", str(tier.nodes), "--dist-init-addr", dist]
        args += ["--node-rank", NODE_RANK]
    return args + list(tier.extra_args)


def _probe(tier: Tier, path: str, failures: int) -> Obj:
    if tier.nodes == 1:
        check: Obj = {"httpGet": {"path": path, "port": tier.port}}
    else:
        # Only node 0 serves HTTP; the other nodes' health is node 0's (it fails without them).
        code = (
            "import os,sys,urllib.request as u;"
            "os.environ['HOSTNAME'].rsplit('-',1)[1]!='0' and sys.exit(0);"
            f"u.urlopen('http://127.0.0.1:{tier.port}{path}',timeout=9)"
        )
        check = {"exec": {"command": ["python3", "-c", code]}}
    return check | {
        "periodSeconds": PROBE_PERIOD_S,
        "timeoutSeconds": PROBE_PERIOD_S,
        "failureThreshold": failures,
    }


def _server(spec: Spec, tier: Tier, i: int) -> list[Obj]:
    dc = spec.datacenters[tier.datacenter]
    ns, name = dc.namespace, instance_name(spec, tier, i)
    argv = _server_args(spec, tier, name, ns)
    # The shell turns the pod's ordinal into SGLang's --node-rank, then becomes SGLang.
    script = "NODE_RANK=${HOSTNAME##*-} && exec " + " ".join(
        '"$NODE_RANK"' if a == NODE_RANK else shlex.quote(a) for a in argv
    )
    ports = [{"name": "http", "containerPort": tier.port}]
    if tier.bootstrap_port is not None:
        ports.append({"name": "bootstrap", "containerPort": tier.bootstrap_port})
    if tier.control_port is not None:
        ports.append({"name": "control", "containerPort": tier.control_port})
    if tier.nodes > 1:
        ports.append({"name": "dist-init", "containerPort": spec.dist_init_port})
    chips = {tier.chip_resource: str(tier.chips_per_pod)}
    volumes: list[Obj] = [
        {"name": "model", **spec.model_volume},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts: list[Obj] = [
        {"name": "model", "mountPath": MODEL_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if tier.control_port is not None:
        volume, mount = _secret_volume(spec)
        volumes.append(volume)
        mounts.append(mount)
    container = {
        "name": "sglang",
        "image": spec.image,
        "command": ["/bin/sh", "-c", script],
        "env": [
            # Mooncake tells its peers this address: the pod's own, routable across the WAN.
            {"name": "SGLANG_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # Mooncake's handshake and data ports, where the NetworkPolicies expect them.
            {"name": "MC_MIN_RPC_PORT", "value": str(spec.mooncake_ports[0])},
            {"name": "MC_MAX_RPC_PORT", "value": str(spec.mooncake_ports[1])},
            *({"name": k, "value": v} for k, v in tier.env.items()),
        ],
        "ports": ports,
        "resources": {"limits": chips, "requests": chips},
        "volumeMounts": mounts,
        "startupProbe": _probe(tier, "/ping", STARTUP_S // PROBE_PERIOD_S),
        "livenessProbe": _probe(tier, "/ping", 3),
        "readinessProbe": _probe(tier, "/health", 3),
    }
    labels = selector(spec, tier.role, name)
    # SGLang's KV-transfer sockets take kernel-chosen ports: pinned to the range the
    # NetworkPolicies admit them on.
    low, high = EPHEMERAL_PORTS
    ephemeral = {"name": "net.ipv4.ip_local_port_range", "value": f"{low} {high}"}
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(spec, name, ns, tier.role),
        "spec": {
            "serviceName": f"{name}-nodes",
            "replicas": tier.nodes,
            # Every node of a multi-node instance must start together to form the TP group.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [container],
                    "volumes": volumes,
                    "securityContext": {"sysctls": [ephemeral]},
                }
                | ({"nodeSelector": tier.node_selector} if tier.node_selector else {}),
            },
        },
    }
    service_ports = [{"name": p["name"], "port": p["containerPort"]} for p in ports]
    nodes = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(spec, f"{name}-nodes", ns, tier.role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # node 0 must be found before it is ready
            "selector": labels,
            "ports": service_ports,
        },
    }
    front = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(spec, name, ns, tier.role),
        "spec": {
            "selector": labels | {"statefulset.kubernetes.io/pod-name": f"{name}-0"},
            "ports": [p for p in service_ports if p["name"] != "dist-init"],
        },
    }
    return [nodes, front, statefulset]


def router_args(spec: Spec) -> list[str]:
    r, dc = spec.router, spec.router.datacenter
    args = ["python3", "-m", "pdd.router"]
    p, rld, md = (spec.tiers[t] for t in ("prefill", "relay", "main"))
    for i in range(p.count):
        args += ["--prefill", instance_url(spec, p, i, dc), str(p.bootstrap_port)]
    for i in range(rld.count):
        args += ["--relay", instance_url(spec, rld, i, dc)]
    for i in range(md.count):
        args += ["--main", instance_url(spec, md, i, dc), str(md.control_port)]
    args += [
        "--host", "0.0.0.0",
        "--port", str(r.port),
        "--control-host", "0.0.0.0",
        "--control-port", str(r.control_port),
        "--control-advertise", "$(POD_IP)",  # each replica its own: MD replies to the sender
        "--secret-file", f"{SECRET_DIR}/{SECRET_KEY}",
        "--tokenizer", spec.model_path,
        "--served-model-name", spec.served_model_name,
    ]  # fmt: skip
    args += ["--control-encrypt"] if spec.control_encrypt else []
    return args + list(r.extra_args)


def _router(spec: Spec) -> list[Obj]:
    r = spec.router
    ns = spec.datacenters[r.datacenter].namespace
    name, labels = f"{spec.name}-router", selector(spec, "router")
    volume, mount = _secret_volume(spec)
    probe = {"httpGet": {"path": "/health", "port": r.port}, "periodSeconds": PROBE_PERIOD_S}
    container = {
        "name": "router",
        "image": spec.image,
        "args": router_args(spec),
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [
            {"name": "http", "containerPort": r.port},
            {"name": "control", "containerPort": r.control_port},
        ],
        "volumeMounts": [
            mount,
            {"name": "model", "mountPath": MODEL_DIR, "readOnly": True},  # the tokenizer
        ],
        "readinessProbe": probe,
        "livenessProbe": probe | {"failureThreshold": 3},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(spec, name, ns, "router"),
        "spec": {
            "replicas": r.replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [container],
                    "volumes": [volume, {"name": "model", **spec.model_volume}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(spec, name, ns, "router"),
        "spec": {"selector": labels, "ports": [{"name": "http", "port": r.port}]},
    }
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta(spec, name, ns, "router"),
        "spec": {"minAvailable": 1, "selector": {"matchLabels": labels}},
    }
    return [deployment, service, budget]


def render(spec: Spec) -> dict[str, list[Obj]]:
    """Every object of the deployment, by datacenter name, in the order to apply them."""
    out: dict[str, list[Obj]] = {}
    for dc in spec.datacenters.values():
        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": dc.namespace}}
        out[dc.name] = [ns, _secret(spec, dc.namespace)]
    for tier in spec.tiers.values():
        for i in range(tier.count):
            out[tier.datacenter] += _server(spec, tier, i)
    out[spec.router.datacenter] += _router(spec)
    for dc, policy in policies(spec):
        out[dc].append(policy)
    return out
