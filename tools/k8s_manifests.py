"""Renders the plain Kubernetes manifests in k8s/ from the Helm chart, or checks they are current.

The chart's defaults and each documented values set (the chart's ci/*-values.yaml) become
k8s/<set>.yaml, rendered with release name `sarathi-cluster` and no namespace, so
`kubectl apply -n NS -f k8s/<set>.yaml` works in any namespace. The `helm test` pod is left out
(it belongs to `helm test`, not to an apply). Usage: `python tools/k8s_manifests.py [--check]`
(--check: exit 1 on drift).
"""

from __future__ import annotations

import argparse
import difflib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from helm_bin import REPO_ROOT, HelmIntegrityError, HelmUnavailable, ensure_helm

CHART_DIR = REPO_ROOT / "deploy" / "helm" / "sarathi-cluster"
K8S_DIR = REPO_ROOT / "k8s"
RELEASE_NAME = "sarathi-cluster"
# The version the manifests are rendered for; the chart needs nothing newer than 1.27.
KUBE_VERSION = "1.30.0"
HEADER = (
    "# GENERATED from deploy/helm/sarathi-cluster with {values} by `make k8s-manifests`;\n"
    "# do not edit (tests/unit/test_helm_chart.py fails when this drifts from the chart).\n"
)


@dataclass(frozen=True)
class ValuesSet:
    name: str
    """Output file stem in k8s/."""
    values_file: Path | None
    """None: the chart's default values."""

    def helm_args(self) -> tuple[str, ...]:
        return ("-f", str(self.values_file)) if self.values_file else ()

    def describe(self) -> str:
        if self.values_file is None:
            return "its default values"
        return str(self.values_file.relative_to(REPO_ROOT))


VALUES_SETS = (
    ValuesSet("demo-cpu-pp2", None),
    ValuesSet("gpu-tp4-pp2", CHART_DIR / "ci" / "gpu-tp4-pp2-values.yaml"),
    ValuesSet("cpu-pp2", CHART_DIR / "ci" / "cpu-pp2-values.yaml"),
)


def helm_template(helm: Path, *args: str) -> str:
    """`helm template sarathi-cluster CHART ARGS...`; raises RuntimeError with helm's message."""
    cmd = [str(helm), "template", RELEASE_NAME, str(CHART_DIR), "--kube-version", KUBE_VERSION]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip() or f"helm template exited {proc.returncode}")
    return proc.stdout


def render(helm: Path, values_set: ValuesSet) -> str:
    manifests = helm_template(helm, "--skip-tests", *values_set.helm_args())
    return HEADER.format(values=values_set.describe()) + manifests


def output_path(values_set: ValuesSet) -> Path:
    return K8S_DIR / f"{values_set.name}.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    try:
        helm = ensure_helm()
    except (HelmUnavailable, HelmIntegrityError) as err:
        print(f"k8s_manifests: {err}", file=sys.stderr)
        return 1
    drifted = []
    for values_set in VALUES_SETS:
        path = output_path(values_set)
        text = render(helm, values_set)
        if not args.check:
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO_ROOT)}")
            continue
        current = path.read_text() if path.is_file() else ""
        if current != text:
            drifted.append(path)
            sys.stdout.writelines(
                difflib.unified_diff(
                    current.splitlines(keepends=True), text.splitlines(keepends=True),
                    str(path.relative_to(REPO_ROOT)), "chart", n=2,
                )
            )  # fmt: skip
    if drifted:
        print(f"{len(drifted)} manifest(s) drifted from the chart: run `make k8s-manifests`")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
