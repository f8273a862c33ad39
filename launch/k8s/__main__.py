"""Render a PDD deployment's Kubernetes manifests, one folder per datacenter.

    python -m pdd.launch.k8s render launch/k8s/example.yaml --out manifests
    kubectl --context dc-a apply -f manifests/a/
    kubectl --context dc-b apply -f manifests/b/

The spec (see launch/k8s/example.yaml) names the model and image, each tier's datacenter, count
and TP size, the chips per node, the WAN-facing addresses and the control-plane secret. Every
object is checked against Kubernetes' schemas before it is written (--no-validate skips that).
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from pdd.launch.cli import command_parser
from pdd.launch.k8s.manifests import render
from pdd.launch.k8s.spec import SpecError, load_spec
from pdd.launch.k8s.validate import KUBERNETES_VERSION, schema_errors


class _Dumper(yaml.SafeDumper):
    """Writes shared dicts out in full: anchors and aliases confuse people reading manifests."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def file_name(n: int, obj: dict[str, object]) -> str:
    meta = obj["metadata"]
    assert isinstance(meta, dict)
    return f"{n:02d}-{str(obj['kind']).lower()}-{meta['name']}.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("pdd.launch.k8s", __doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("render", help="write the manifests of a spec")
    cmd.add_argument("spec", type=Path)
    cmd.add_argument("--out", type=Path, required=True, help="a folder per datacenter goes here")
    cmd.add_argument("--kubernetes-version", default=KUBERNETES_VERSION)
    cmd.add_argument("--no-validate", action="store_true")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.spec)
    except (SpecError, OSError) as err:
        parser.error(f"{args.spec}: {err}")
    objects = render(spec)
    if not args.no_validate:
        errors = [e for objs in objects.values() for o in objs
                  if (e := schema_errors(o, args.kubernetes_version))]  # fmt: skip
        if errors:
            print("\n".join(["rendered objects fail Kubernetes' schemas:", *errors]))
            return 1
    for dc, objs in objects.items():
        folder = args.out / dc
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.yaml"):
            old.unlink()  # a re-render must not leave objects the spec no longer has
        for n, obj in enumerate(objs):
            (folder / file_name(n, obj)).write_text(yaml.dump(obj, Dumper=_Dumper, sort_keys=False))
        namespace = spec.datacenters[dc].namespace
        print(f"{folder}: {len(objs)} objects (namespace {namespace})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
