"""Exceptions shared by every role; each names what failed and with which value."""


class PersiaError(RuntimeError):
    """Base class of runtime errors raised by persia."""


class RemoteError(PersiaError):
    """A peer answered a request with an error (its message is kept verbatim)."""

    def __init__(self, subject: str, message: str, kind: str = "error"):
        super().__init__(f"{subject}: {message}")
        self.subject = subject
        self.remote_message = message
        self.kind = kind


class BusyError(PersiaError):
    """A peer's buffer stayed full until the deadline: back-pressure that did not clear."""


class DiscoveryTimeout(PersiaError):
    """A role we need never announced itself in time."""


class DataLoaderFailed(PersiaError):
    """A data loader ended its stream with an error, so the epoch is incomplete."""
