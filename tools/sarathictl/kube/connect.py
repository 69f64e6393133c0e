"""The Kubernetes API client of `sarathictl`: the usual kubeconfig, or the pod's service account,
and the namespace to look in; clear errors when there is neither."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class KubeConfigError(ValueError):
    """No way to reach the Kubernetes API (said in one line, without a traceback)."""


@dataclass
class KubeApi:
    """The API groups the command reads, and the namespace it reads them in."""

    core: Any  # kubernetes.client.CoreV1Api
    apps: Any  # kubernetes.client.AppsV1Api
    namespace: str
    server: str
    """The API server's URL, for messages."""


def connect(kubeconfig: str = "", context: str = "", namespace: str = "") -> KubeApi:
    """kubeconfig: a file, else $KUBECONFIG or ~/.kube/config, else the service account of the
    pod this runs in. namespace: given, else the kubeconfig context's, else the pod's, else
    "default"."""
    from kubernetes import client, config

    api_client, context_namespace = _kubeconfig_client(kubeconfig, context)
    if api_client is None:
        try:
            config.load_incluster_config()
        except config.ConfigException as err:
            where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
            raise KubeConfigError(
                f"no Kubernetes configuration: no kubeconfig at {where} (--kubeconfig, "
                f"$KUBECONFIG) and not running in a pod with a service account ({err})"
            ) from None
        api_client = client.ApiClient()
        if _SERVICE_ACCOUNT_NAMESPACE.is_file():
            context_namespace = _SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return KubeApi(
        core=client.CoreV1Api(api_client),
        apps=client.AppsV1Api(api_client),
        namespace=namespace or context_namespace or "default",
        server=str(api_client.configuration.host),
    )


def _kubeconfig_client(kubeconfig: str, context: str) -> tuple[Any, str]:
    """(an ApiClient, the context's namespace) from a kubeconfig file; (None, "") when there is
    no file and none was named."""
    from kubernetes import config

    path = kubeconfig or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    path = path or str(Path.home() / ".kube" / "config")
    if not Path(path).expanduser().is_file():
        if kubeconfig:
            raise KubeConfigError(f"--kubeconfig {kubeconfig}: no such file")
        return None, ""
    try:
        contexts, active = config.list_kube_config_contexts(config_file=path)
        chosen = next((c for c in contexts if c["name"] == context), None) if context else active
        if context and chosen is None:
            names = ", ".join(c["name"] for c in contexts)
            raise KubeConfigError(f"--context {context}: not in {path} (it has: {names})")
        api_client = config.new_client_from_config(config_file=path, context=context or None)
    except config.ConfigException as err:
        raise KubeConfigError(f"kubeconfig {path}: {err}") from None
    namespace = str((chosen or {}).get("context", {}).get("namespace", "") or "")
    return api_client, namespace
