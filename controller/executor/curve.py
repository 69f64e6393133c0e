"""Optional CurveZMQ on the control plane: encryption, and only workers whose public keys are
listed may connect. Key files are ZeroMQ certificates (`zmq.auth.create_certificates`; text, no
pickle), e.g. mounted from a Kubernetes Secret."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from controller.scheduler import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CurveServerKeys:
    secret_key_file: str
    """The controller's certificate with its secret key (`*.key_secret`)."""
    client_keys_dir: str
    """Folder of the workers' public certificates (`*.key`); only they may connect."""

    def __post_init__(self) -> None:
        if not Path(self.secret_key_file).is_file():
            raise ConfigError("curve_secret_key_file", self.secret_key_file, "a readable file")
        if not Path(self.client_keys_dir).is_dir():
            raise ConfigError("curve_client_keys_dir", self.client_keys_dir, "a folder")


def secure_router(
    ctx: zmq.asyncio.Context, sock: zmq.asyncio.Socket, keys: CurveServerKeys
) -> AsyncioAuthenticator:
    """Makes sock a CURVE server that admits only the listed workers; keep the authenticator
    alive (and stop it) with the socket."""
    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=keys.client_keys_dir)
    public, secret = zmq.auth.load_certificate(keys.secret_key_file)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    log.info("control plane requires CurveZMQ keys from %s", keys.client_keys_dir)
    return auth
