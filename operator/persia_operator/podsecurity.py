"""The restricted security contexts every rendered pod gets by default (Pod Security
Standards "restricted": non-root, no privilege escalation, no capabilities, the runtime's
default seccomp profile). `spec.securityContext: none` leaves them to the templates."""

from __future__ import annotations

from typing import Any

# the images' own user (`persia`, images/*.Dockerfile): files it wrote on a volume whose storage
# ignores fsGroup (many NFS / RWX classes) stay its own across pods; the images need no writable
# home (HOME=/tmp)
RUN_AS = 65532


def pod_security_context() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"}}  # fmt: skip


def container_security_context(read_only: bool) -> dict[str, Any]:
    """`read_only`: a read-only root filesystem (roles that run no user code)."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": read_only}  # fmt: skip
