"""Credentials, TLS and control-message signatures, all read from the environment.

Names are the ones agreed in CONTRACTS.md (the operator sets them from Secrets). Everything here
is a pure function of the environment or of its arguments, so it is tested without servers; the
bus, the gRPC layer and the local launcher are the thin shells that use it. Secrets are read from
env or files and passed to children through env or files, never through argv or logs.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import ssl
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger(__name__)

DEFAULT_BIND_ADDRESS = "0.0.0.0"


class Unauthorized(Exception):
    """A control message that is not signed by this job (or is replayed or stale)."""


# -- bind address ---------------------------------------------------------------------------------
def bind_address(env: Mapping[str, str] | None = None) -> str:
    """Where every listener binds: ``PERSIA_BIND_ADDRESS`` (pod IP on Kubernetes, loopback in local
    mode); ``PERSIA_BIND_HOST`` is the older name. Unset: all interfaces, as PERSIA did."""
    env = os.environ if env is None else env
    return env.get("PERSIA_BIND_ADDRESS") or env.get("PERSIA_BIND_HOST") or DEFAULT_BIND_ADDRESS


# -- NATS -----------------------------------------------------------------------------------------
def redact_url(url: str) -> str:
    """``nats://user:pw@host:4222`` -> ``nats://***@host:4222`` (for every log line and message)."""
    out = []
    for part in url.split(","):
        if "@" not in part:
            out.append(part)
            continue
        split = urlsplit(part if "://" in part else f"nats://{part}")
        host = split.netloc.rsplit("@", 1)[1]
        out.append(urlunsplit(split._replace(netloc=f"***@{host}")))
    return ",".join(out)


def _readable_file(env: Mapping[str, str], name: str) -> str | None:
    path = env.get(name)
    if not path:
        return None
    if not os.path.isfile(path):
        raise ValueError(f"{name}={path!r}: no such file")
    return path


@dataclass(frozen=True)
class NatsAuth:
    """How to authenticate to NATS, parsed from ``PERSIA_NATS_*`` (credentials in the URL are
    handled by nats-py itself)."""

    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "NatsAuth":
        env = os.environ if env is None else env
        user, password = env.get("PERSIA_NATS_USER") or None, env.get("PERSIA_NATS_PASSWORD") or None
        if bool(user) != bool(password):
            raise ValueError("PERSIA_NATS_USER and PERSIA_NATS_PASSWORD must be set together")
        token = env.get("PERSIA_NATS_TOKEN") or None
        if token and user:
            raise ValueError("set either PERSIA_NATS_TOKEN or PERSIA_NATS_USER/PASSWORD, not both")
        cert, key = _readable_file(env, "PERSIA_NATS_TLS_CERT"), _readable_file(env, "PERSIA_NATS_TLS_KEY")
        if bool(cert) != bool(key):
            raise ValueError("PERSIA_NATS_TLS_CERT and PERSIA_NATS_TLS_KEY must be set together")
        return cls(user=user, password=password, token=token,
                   creds_file=_readable_file(env, "PERSIA_NATS_CREDS"),
                   tls_ca=_readable_file(env, "PERSIA_NATS_TLS_CA"), tls_cert=cert, tls_key=key)

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)

    def connect_kwargs(self) -> dict:
        """Keyword arguments for ``nats.connect``."""
        kw: dict = {}
        if self.user:
            kw.update(user=self.user, password=self.password)
        if self.token:
            kw["token"] = self.token
        if self.creds_file:
            try:
                import nkeys  # noqa: F401 - nats-py needs it for .creds and nkey seeds
            except ImportError:
                raise ValueError(
                    "PERSIA_NATS_CREDS needs the 'nkeys' package (pip install nkeys)"
                ) from None
            text = Path(self.creds_file).read_text()
            if "BEGIN NATS USER JWT" in text:
                kw["user_credentials"] = self.creds_file
            else:
                kw["nkeys_seed"] = self.creds_file
        if self.uses_tls:
            ctx = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
            kw["tls"] = ctx
        return kw


def with_tls_scheme(servers: list[str], auth: NatsAuth) -> list[str]:
    """nats-py starts TLS only for ``tls://`` URLs or when the server demands it: with a CA or a
    client certificate configured, ask for it explicitly so a plaintext server is refused."""
    if not auth.uses_tls:
        return servers
    return ["tls://" + s.split("://", 1)[1] if s.startswith("nats://") else s for s in servers]


# -- gRPC -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GrpcTls:
    """``PERSIA_GRPC_TLS_{CA,CERT,KEY}``: servers need CERT+KEY (and require client certificates,
    mutual TLS, when CA is given too); clients need CA (and present CERT+KEY when given)."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "GrpcTls":
        env = os.environ if env is None else env
        paths = {k: _readable_file(env, f"PERSIA_GRPC_TLS_{k.upper()}") for k in ("ca", "cert", "key")}
        if bool(paths["cert"]) != bool(paths["key"]):
            raise ValueError("PERSIA_GRPC_TLS_CERT and PERSIA_GRPC_TLS_KEY must be set together")
        return cls(**{k: Path(p).read_bytes() if p else None for k, p in paths.items()})

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert)

    def server_credentials(self):
        import grpc

        if not self.cert:
            raise ValueError("gRPC TLS on a server needs PERSIA_GRPC_TLS_CERT and PERSIA_GRPC_TLS_KEY")
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=self.ca is not None
        )

    def channel_credentials(self):
        import grpc

        if not self.ca:
            raise ValueError("gRPC TLS on a client needs PERSIA_GRPC_TLS_CA")
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


GRPC_AUTH_METADATA = "persia-auth"
"""The gRPC metadata key of a call's job credential (:func:`grpc_token`)."""

_DERIVED: dict[tuple[bytes, bytes], bytes] = {}


def derived_key(secret: bytes | None, purpose: bytes) -> bytes | None:
    """``HMAC-SHA256(secret, purpose)`` (None without a secret): a key of its own for each use, so
    the secret itself keys nothing but signatures and never travels. Cached: some are asked for
    once per batch."""
    if not secret:
        return None
    key = _DERIVED.get((secret, purpose))
    if key is None:
        key = _DERIVED[(secret, purpose)] = hmac.new(secret, purpose, hashlib.sha256).digest()
    return key


def grpc_token(secret: bytes | None) -> str | None:
    """The credential every PERSIA gRPC call carries when the job has a secret (None without
    one), in hex."""
    key = derived_key(secret, b"persia grpc v1")
    return None if key is None else key.hex()


def grpc_token_matches(value: str | bytes | None, token: str) -> bool:
    """Whether a call's ``persia-auth`` metadata value is ``token``, in constant time (any value
    that is not even text, a non-ASCII one included, is a mismatch, not an error)."""
    if value is None:
        return False
    try:
        got = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else bytes(value)
    except (TypeError, ValueError):
        return False
    return hmac.compare_digest(got, token.encode())


# -- signed control messages ----------------------------------------------------------------------
SIGNED_METHODS = frozenset({
    ("ps", "clear"), ("ps", "dump"), ("ps", "load"), ("ps", "configure"), ("ps", "register_optimizer"),
    ("ps", "stage"), ("ps", "start"), ("ps", "commit"), ("ps", "abort"),
    ("nn", "eos"), ("nn", "batch"), ("nn", "batch_group"),
    ("ew", "release"),  # destroys buffered ID features (a released ref is refused when it comes)
    ("nn", "done"),  # an event: tells data loaders to give up on a rank (NatsBus.subscribe_events verifies)
})
"""Controls that destroy state, write files, end training or feed it: signed when a job secret is
set. (``ew.forward`` and ``ew.forward_group`` are not, their payload is the largest: their refs are
keyed with the secret instead, :func:`batch_ref`, so a forged one cannot take a batch's place, and
otherwise it only fills a bounded, expiring buffer.)"""

SIGNATURE_HEADER = "Persia-Signature"
MAX_SKEW_S = 300.0


def needs_signature(subj: str) -> bool:
    """``persia.<job>.<service>.<method>[.<replica>]`` with (service, method) in SIGNED_METHODS."""
    parts = subj.split(".")
    return len(parts) >= 4 and parts[0] == "persia" and (parts[2], parts[3]) in SIGNED_METHODS


def job_secret(env: Mapping[str, str] | None = None) -> bytes | None:
    env = os.environ if env is None else env
    raw = env.get("PERSIA_JOB_SECRET")
    return raw.encode() if raw else None


def new_secret() -> str:
    return secrets.token_hex(32)


def _mac(secret: bytes, subj: str, ts: str, nonce: str, payload: bytes) -> str:
    h = hmac.new(secret, f"v1\n{subj}\n{ts}\n{nonce}\n".encode(), hashlib.sha256)
    h.update(payload)
    return h.hexdigest()


def sign(secret: bytes, subj: str, payload: bytes, now: float | None = None) -> str:
    """Header value ``v1:<unix time>:<nonce>:<hmac-sha256>`` over subject, time, nonce and payload.
    The subject names the job and the replica, so a signature is valid for one target only."""
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(12)
    return f"v1:{ts}:{nonce}:{_mac(secret, subj, ts, nonce, payload)}"


class SignatureChecker:
    """Verifies signatures; refuses stale ones (clock skew window) and replays (nonces seen).

    A signature is accepted while ``|now - sent| <= max_skew_s``: until ``sent + max_skew_s``, which
    is later than ``now + max_skew_s`` for a sender whose clock runs ahead. So each nonce is kept
    until ``max(now, sent) + max_skew_s``, the end of its own validity: a nonce forgotten is one
    whose header is stale anyway (keeping it only ``max_skew_s`` after receipt let a header signed
    200 s ahead be replayed once a later message evicted it)."""

    def __init__(self, secret: bytes, max_skew_s: float = MAX_SKEW_S):
        self.secret = secret
        self.max_skew_s = max_skew_s
        # nonce -> the time its signature stops being valid, in arrival order: almost sorted (only
        # clocks ahead come later), and one evicted late is kept longer, never shorter
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, subj: str, payload: bytes, header: str | None, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if not header:
            raise Unauthorized(f"{subj}: unsigned control message (this job requires PERSIA_JOB_SECRET signatures)")
        parts = header.split(":")
        if len(parts) != 4 or parts[0] != "v1":
            raise Unauthorized(f"{subj}: malformed signature header")
        _, ts, nonce, mac = parts
        try:
            sent = float(ts)
        except ValueError:
            raise Unauthorized(f"{subj}: malformed signature time") from None
        if not hmac.compare_digest(mac, _mac(self.secret, subj, ts, nonce, payload)):
            raise Unauthorized(f"{subj}: bad signature (not signed with this job's secret)")
        if abs(now - sent) > self.max_skew_s:
            raise Unauthorized(f"{subj}: signature is {now - sent:.0f}s old (allowed: {self.max_skew_s:.0f}s)")
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now:
                self._seen.popitem(last=False)  # O(1) per message: entries arrive (nearly) in expiry order
            if nonce in self._seen:
                raise Unauthorized(f"{subj}: replayed control message")
            self._seen[nonce] = max(now, sent) + self.max_skew_s


# -- batch refs ------------------------------------------------------------------------------------
def ref_key(secret: bytes | None) -> bytes | None:
    """The key of :func:`batch_ref`, derived from the job secret (None without one)."""
    return derived_key(secret, b"persia batch ref v1")


def batch_ref(session: str | None, loader: int, batch_id: int, key: bytes | None) -> int:
    """The ref under which a batch's ID features wait on their embedding worker (62 bits), chosen
    by the data loader. With ``key`` (:func:`ref_key` of the job secret) it is a keyed hash, which
    the worker recomputes: nobody without the secret can name a future batch's ref, so a forged
    ``ew.forward`` cannot buffer its IDs under it first. About 1 µs."""
    digest = hashlib.blake2b(f"{session}/{loader}/{batch_id}".encode(), digest_size=8, key=key or b"").digest()
    return int.from_bytes(digest, "big") >> 2


# -- checkpoint root ------------------------------------------------------------------------------
def checkpoint_root(env: Mapping[str, str] | None = None, config_dir: str | None = None) -> str | None:
    """The directory every checkpoint path sent over NATS must lie under:
    ``PERSIA_CHECKPOINT_ROOT``, else ``PERSIA_CHECKPOINT_DIR``, else the configured checkpoint_dir."""
    env = os.environ if env is None else env
    root = env.get("PERSIA_CHECKPOINT_ROOT") or env.get("PERSIA_CHECKPOINT_DIR") or config_dir
    return root or None


def check_under_root(path: str, root: str | None, field: str = "dir") -> Path:
    """``path`` resolved (symlinks and ``..`` included); ValueError if it leaves ``root``."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{field} must be a non-empty path string, got {path!r}")
    if "://" in path:
        raise ValueError(f"{field} {path!r}: only local/mounted paths are supported")
    resolved = Path(os.path.realpath(path))
    if root is None:
        return resolved
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, str(resolved)]) != real_root:
        raise ValueError(f"{field} {path!r} is outside the checkpoint root {root!r} (PERSIA_CHECKPOINT_ROOT)")
    return resolved
