"""Kubernetes manifests from a deployment spec: valid against Kubernetes' own schemas (offline,
kubernetes-validate), the flags each tier needs, and bad specs refused naming the field."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdd.launch.k8s.manifests import render, router_args
from pdd.launch.k8s.spec import SpecError, parse_spec
from pdd.launch.k8s.validate import schema_errors

EXAMPLE = Path(__file__).parent.parent / "launch" / "k8s" / "example.yaml"


@pytest.fixture
def base(tmp_path: Path) -> Path:
    (tmp_path / "control.secret").write_text("0123456789abcdef0123456789abcdef\n")
    return tmp_path


def example() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return doc


def multi_node() -> dict[str, Any]:
    """MD with TP 16 over two 8-chip nodes, P with TP 4 on half a node."""
    doc = example()
    doc["main"]["tp"] = 16
    doc["prefill"]["tp"] = 4
    doc["model"]["path"] = "/models/Qwen 2.5"
    return doc


def objects(doc: dict[str, Any], base: Path) -> dict[str, list[dict[str, Any]]]:
    return render(parse_spec(doc, base))


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [obj] = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def sglang_command(statefulset: dict[str, Any]) -> str:
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    command: str = container["command"][2]
    return command


@pytest.mark.parametrize("spec", [example, multi_node], ids=["example", "multi-node-tp"])
def test_every_rendered_object_passes_kubernetes_schemas(spec: Any, base: Path) -> None:
    out = objects(spec(), base)
    assert set(out) == {"a", "b"}
    kinds = sorted({o["kind"] for objs in out.values() for o in objs})
    assert kinds == sorted(["Namespace", "Secret", "Service", "StatefulSet", "NetworkPolicy",
                            "Deployment", "PodDisruptionBudget"])  # fmt: skip
    errors = [e for objs in out.values() for o in objs if (e := schema_errors(o))]
    assert errors == []


def test_the_schema_check_catches_a_wrong_object(base: Path) -> None:
    """The validation above can fail: a wrong type and an unknown field are both reported."""
    sts = copy.deepcopy(find(objects(example(), base)["b"], "StatefulSet", "pdd-main-0"))
    sts["spec"]["replicas"] = "two"
    assert "replicas" in (schema_errors(sts) or "")
    sts = copy.deepcopy(find(objects(example(), base)["b"], "StatefulSet", "pdd-main-0"))
    sts["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8
    assert "gpus" in (schema_errors(sts) or "")


def test_each_tier_gets_its_pdd_flags_and_chips(base: Path) -> None:
    out = objects(example(), base)
    p = sglang_command(find(out["a"], "StatefulSet", "pdd-prefill-1"))
    assert "--pdd-role prefill --disaggregation-mode prefill" in p
    assert "--disaggregation-bootstrap-port 8998" in p and "--tp-size 8" in p
    md_sts = find(out["b"], "StatefulSet", "pdd-main-0")
    md = sglang_command(md_sts)
    assert "--pdd-role main --disaggregation-mode decode" in md
    assert "--pdd-control-port 7500 --pdd-secret-file /etc/pdd/control.secret" in md
    assert md.endswith("--max-running-requests 128")  # the spec's extra_args
    assert "--nnodes" not in md
    pod = md_sts["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"} in pod["containers"][0]["env"]
    [container] = md_sts["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    rld = find(out["a"], "StatefulSet", "pdd-relay-0")
    assert rld["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "nvidia.com/gpu": "2"
    }
    # RLD is small: 2 chips and 32 requests against MD's 2 x 8 chips and 2 x 128 requests.
    assert sglang_command(rld).endswith("--max-running-requests 32")
    assert [o["metadata"]["name"] for o in out["a"] if o["kind"] == "StatefulSet"].count(
        "pdd-relay-1"
    ) == 0
    # The secret reaches both datacenters, with the same bytes.
    secrets = [find(out[dc], "Secret", "pdd-control")["data"] for dc in ("a", "b")]
    assert secrets[0] == secrets[1] and secrets[0]["control.secret"]


def test_router_addresses_each_instance_and_advertises_its_own_pod_ip(base: Path) -> None:
    spec = parse_spec(example(), base)
    args = router_args(spec)
    joined = " ".join(args)
    # P by its WAN name (MD in b connects to its bootstrap server), RLD in-cluster, MD over WAN.
    assert "--prefill http://p0.dc-a.example.com:30000 8998" in joined
    assert "--prefill http://p1.dc-a.example.com:30000 8998" in joined
    assert "--relay http://pdd-relay-0.pdd.svc:30001" in joined
    assert "--main http://md0.dc-b.example.com:30002 7500" in joined
    assert "--main http://md1.dc-b.example.com:30002 7500" in joined
    assert args[args.index("--control-advertise") + 1] == "$(POD_IP)"
    deployment = find(render(spec)["a"], "Deployment", "pdd-router")
    assert deployment["spec"]["replicas"] == 2


def test_secret_encrypt_turns_curve_on_for_md_and_the_routers_alike(base: Path) -> None:
    plain = objects(example(), base)
    assert "encrypt" not in " ".join(router_args(parse_spec(example(), base)))
    assert "encrypt" not in sglang_command(find(plain["b"], "StatefulSet", "pdd-main-0"))
    doc = example()
    doc["secret"]["encrypt"] = True
    assert "--control-encrypt" in router_args(parse_spec(doc, base))
    out = objects(doc, base)
    assert "--pdd-control-encrypt" in sglang_command(find(out["b"], "StatefulSet", "pdd-main-0"))
    assert "encrypt" not in sglang_command(find(out["a"], "StatefulSet", "pdd-prefill-0"))


LABELS = {"app.kubernetes.io/name": "pdd"}
A, B = [{"ipBlock": {"cidr": "10.10.0.0/16"}}], [{"ipBlock": {"cidr": "10.20.0.0/16"}}]
EPHEMERAL, MOONCAKE = (32768, 60999), (15000, 17000)


def pods(role: str) -> list[dict[str, Any]]:
    """A policy's peer: the pods of `role` in the policy's own datacenter, by label."""
    return [{"podSelector": {"matchLabels": LABELS | {"app.kubernetes.io/component": role}}}]


def rules(policy: dict[str, Any], role: str) -> list[tuple[Any, list[tuple[int, int]]]]:
    """A policy's ingress rules, as (peers or None for anyone, [(first port, last port)]), after
    checking that it selects the pods of `role` and isolates them for ingress."""
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == LABELS | {"app.kubernetes.io/component": role}
    assert spec["policyTypes"] == ["Ingress"]
    out = []
    for rule in spec["ingress"]:
        assert all(p["protocol"] == "TCP" for p in rule["ports"])
        ports = [(p["port"], p.get("endPort", p["port"])) for p in rule["ports"]]
        out.append((rule.get("from"), ports))
    return out


def test_each_server_port_admits_only_the_pods_that_connect_to_it(base: Path) -> None:
    """Datacenter a holds P, RLD and the routers, b holds MD: peers in a policy's own datacenter
    are named by label, those of the other by its egress_cidrs."""
    out = objects(example(), base)
    p = rules(find(out["a"], "NetworkPolicy", "pdd-prefill"), "prefill")
    assert p == [
        # HTTP: the routers, and the decoders (SGLang re-runs a retracted request's prefill).
        (pods("router") + pods("relay") + B, [(30000, 30000)]),
        # The bootstrap server and P's KV-transfer ZMQ sockets: the decoders.
        (pods("relay") + B, [(8998, 8998), EPHEMERAL]),
    ]
    rld = rules(find(out["a"], "NetworkPolicy", "pdd-relay"), "relay")
    assert rld == [
        (pods("router"), [(30001, 30001)]),
        (pods("prefill"), [EPHEMERAL, MOONCAKE]),  # P's status messages and KV writes
    ]
    md = rules(find(out["b"], "NetworkPolicy", "pdd-main"), "main")
    assert md == [(A, [(30002, 30002)]), (A, [EPHEMERAL, MOONCAKE]), (A, [(7500, 7500)])]
    # Every port a server declares is admitted by some rule; single-node instances get no
    # policy of their own.
    for dc, objs in out.items():
        admitted = {
            port
            for o in objs
            if o["kind"] == "NetworkPolicy"
            for rule in o["spec"]["ingress"]
            for p in rule["ports"]
            for port in range(p["port"], p.get("endPort", p["port"]) + 1)
        }
        for sts in (o for o in objs if o["kind"] == "StatefulSet"):
            [container] = sts["spec"]["template"]["spec"]["containers"]
            assert {p["containerPort"] for p in container["ports"]} <= admitted, (dc, sts)
    assert not [n for dc in out for o in out[dc] if o["kind"] == "NetworkPolicy"
                and (n := o["metadata"]["name"]).endswith("-nodes")]  # fmt: skip


def test_the_router_serves_clients_and_admits_only_md_on_its_control_port(base: Path) -> None:
    router = rules(find(objects(example(), base)["a"], "NetworkPolicy", "pdd-router"), "router")
    assert router == [(None, [(8000, 8000)]), (B, [(7600, 7600)])]  # clients from anywhere
    doc = example()
    doc["router"]["client_cidrs"] = ["192.0.2.0/24"]
    router = rules(find(objects(doc, base)["a"], "NetworkPolicy", "pdd-router"), "router")
    assert router[0] == ([{"ipBlock": {"cidr": "192.0.2.0/24"}}], [(8000, 8000)])


def test_routers_in_mds_datacenter_are_named_by_label_there_and_by_cidr_elsewhere(
    base: Path,
) -> None:
    doc = example()
    doc["router"]["datacenter"] = "b"
    doc["relay"]["wan_addresses"] = ["r0.dc-a.example.com"]
    out = objects(doc, base)
    md = rules(find(out["b"], "NetworkPolicy", "pdd-main"), "main")
    assert md[0] == (pods("router"), [(30002, 30002)]) and md[2] == (pods("router"), [(7500, 7500)])
    # P's HTTP port: routers and MD both come from b, named once.
    p = rules(find(out["a"], "NetworkPolicy", "pdd-prefill"), "prefill")
    assert p[0] == (B + pods("relay"), [(30000, 30000)])
    router = rules(find(out["b"], "NetworkPolicy", "pdd-router"), "router")
    assert router[1] == (pods("main"), [(7600, 7600)])


def test_server_pods_pin_the_ports_the_policies_name(base: Path) -> None:
    """Mooncake's handshake and data ports come from MC_MIN/MAX_RPC_PORT; the ZMQ sockets from
    the pod's ephemeral port range."""
    doc = example()
    doc["mooncake_ports"] = {"min": 20000, "max": 20015}
    out = objects(doc, base)
    for dc, name in (("a", "pdd-prefill-0"), ("a", "pdd-relay-0"), ("b", "pdd-main-1")):
        pod = find(out[dc], "StatefulSet", name)["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["MC_MIN_RPC_PORT"] == "20000" and env["MC_MAX_RPC_PORT"] == "20015"
        sysctls = pod["securityContext"]["sysctls"]
        assert sysctls == [{"name": "net.ipv4.ip_local_port_range", "value": "32768 60999"}]
    md = rules(find(out["b"], "NetworkPolicy", "pdd-main"), "main")
    assert md[1] == (A, [EPHEMERAL, (20000, 20015)])


def test_multi_node_instance_takes_its_node_rank_from_the_pod_ordinal(base: Path) -> None:
    out = objects(multi_node(), base)
    sts = find(out["b"], "StatefulSet", "pdd-main-0")
    assert sts["spec"]["replicas"] == 2 and sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["serviceName"] == "pdd-main-0-nodes"
    headless = find(out["b"], "Service", "pdd-main-0-nodes")
    assert headless["spec"]["clusterIP"] == "None"
    front = find(out["b"], "Service", "pdd-main-0")
    assert front["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == "pdd-main-0-0"
    command = sglang_command(sts)
    assert "--tp-size 16 " in command
    assert "--nnodes 2 --dist-init-addr pdd-main-0-0.pdd-main-0-nodes.pdd.svc:5000" in command
    # Run the pod's shell line with `printf` as SGLang, an argument per line: pod 1 of the
    # StatefulSet is node rank 1, and a model path with a space stays one argument.
    line = command.replace("exec python3", "exec printf '%s\\n' python3")
    env = {**os.environ, "HOSTNAME": "pdd-main-0-1"}
    run = subprocess.run(["/bin/sh", "-c", line], env=env, capture_output=True, text=True)
    argv = run.stdout.splitlines()
    assert run.returncode == 0 and argv[argv.index("--node-rank") + 1] == "1", run
    assert argv[argv.index("--model-path") + 1] == "/models/Qwen 2.5"
    # The nodes of an instance reach each other on any port (NCCL, Gloo, dist-init), and no
    # other instance's pods do.
    nodes = find(out["b"], "NetworkPolicy", "pdd-main-0-nodes")["spec"]
    instance = LABELS | {"app.kubernetes.io/component": "main", "pdd.dev/instance": "pdd-main-0"}
    assert nodes["podSelector"]["matchLabels"] == instance
    assert nodes["ingress"] == [{"from": [{"podSelector": {"matchLabels": instance}}]}]
    p = find(out["a"], "StatefulSet", "pdd-prefill-0")
    assert p["spec"]["replicas"] == 1 and "--nnodes" not in sglang_command(p)
    assert not [o for o in out["a"] if o["metadata"]["name"] == "pdd-prefill-0-nodes"
                and o["kind"] == "NetworkPolicy"]  # fmt: skip
    [container] = p["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "4"}


def _without(doc: dict[str, Any], key: str) -> dict[str, Any]:
    doc.pop(key)
    return doc


def _set(doc: dict[str, Any], tier: str, key: str, value: Any) -> dict[str, Any]:
    doc[tier][key] = value
    return doc


def _with(doc: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    doc[key] = value
    return doc


BAD = {
    "no model": (lambda: _without(example(), "model"), "model"),
    "no model path": (lambda: _set(example(), "model", "path", None), "model.path"),
    "tp not dividing the chips": (lambda: _set(example(), "prefill", "tp", 3), "prefill.tp"),
    "tp over partial nodes": (lambda: _set(example(), "main", "tp", 12), "main.tp"),
    "md without a secret": (lambda: _without(example(), "secret"), "secret.file"),
    "encrypt not a bool": (
        lambda: _with(example(), "secret", {"file": "control.secret", "encrypt": "yes"}),
        "secret.encrypt",
    ),  # fmt: skip
    "two tiers on one port": (lambda: _set(example(), "relay", "port", 30000), "relay.port"),
    "md port as router port": (
        lambda: _set(example(), "main", "control_port", 8000),
        "main.control_port",
    ),  # fmt: skip
    "unknown datacenter": (lambda: _set(example(), "main", "datacenter", "c"), "main.datacenter"),
    "md unreachable": (lambda: _set(example(), "main", "wan_addresses", []), "main.wan_addresses"),
    "env not strings": (lambda: _set(example(), "main", "env", {"A": 1}), "main.env"),
    "env the render sets": (
        lambda: _set(example(), "relay", "env", {"MC_MIN_RPC_PORT": "20000"}),
        "relay.env",
    ),  # fmt: skip
    "no cidrs for md's datacenter": (
        lambda: _set(example(), "datacenters", "b", {"namespace": "pdd"}),
        "datacenters.b.egress_cidrs",
    ),  # fmt: skip
    "bad client cidr": (
        lambda: _set(example(), "router", "client_cidrs", ["10.0.0.0/33"]),
        "router.client_cidrs",
    ),  # fmt: skip
    "mooncake ports in the ephemeral range": (
        lambda: _with(example(), "mooncake_ports", {"min": 30000, "max": 40000}),
        "mooncake_ports",
    ),  # fmt: skip
    "mooncake ports fewer than a pod's engines": (
        lambda: _with(example(), "mooncake_ports", {"min": 20000, "max": 20014}),
        "mooncake_ports",
    ),  # fmt: skip
    "a port in the mooncake range": (
        lambda: _set(example(), "relay", "port", 16000),
        "relay.port",
    ),  # fmt: skip
    "wrong address count": (
        lambda: _set(example(), "prefill", "wan_addresses", ["p0"]),
        "prefill.wan_addresses",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_a_bad_spec_is_refused_naming_the_field(case: str, base: Path) -> None:
    make, field = BAD[case]
    with pytest.raises(SpecError) as err:
        parse_spec(make(), base)
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")


def test_render_command_writes_a_folder_per_datacenter(base: Path) -> None:
    spec = base / "spec.yaml"
    spec.write_text(EXAMPLE.read_text())
    out = base / "out"
    cmd = [sys.executable, "-m", "pdd.launch.k8s", "render", str(spec), "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    files = {dc: sorted(p.name for p in (out / dc).iterdir()) for dc in ("a", "b")}
    assert files["b"][0] == "00-namespace-pdd.yaml"
    assert "04-statefulset-pdd-main-0.yaml" in files["b"]
    written = yaml.safe_load((out / "b" / "04-statefulset-pdd-main-0.yaml").read_text())
    assert written["kind"] == "StatefulSet" and schema_errors(written) is None
    (base / "control.secret").unlink()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "secret.file: cannot read" in run.stderr
