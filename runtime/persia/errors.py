"""Exceptions shared by every role; each names what failed and with which value."""


INPUT_ERRORS = (ValueError, TypeError, LookupError)
"""What a handler raises for bad input (KeyError is a LookupError): answered to the caller as its
fault, not logged as the role's own failure (``persia.bus``, ``persia.rpc``, a batch of a group)."""


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


class PersiaValidationError(ValueError, AssertionError):
    """Bad input, named with its value. Also an ``AssertionError``: PERSIA checked these with
    ``assert``, and its users' ``except AssertionError`` must keep catching them."""


class UnsupportedError(PersiaError, NotImplementedError):
    """A PERSIA feature this runtime does not provide; the message names what to use instead."""


class ContextRequired(PersiaError, AssertionError):
    """Used outside the context it needs (PERSIA asserted ``cnt_ctx()``)."""


class BatchLost(PersiaError, LookupError):
    """A batch's ID features will never reach its embedding worker: its data loader gave up on
    them, or they did not arrive within the lookup wait. The NN worker counts the batch as failed
    and goes on (``persia.nn_worker.loader``)."""

    grpc_status = "NOT_FOUND"

    def __init__(self, message: str, loader: int | None = None):
        super().__init__(message)
        self.loader = loader  # the data loader whose batch it was, when the NN worker knows it


class TooManyWaiting(PersiaError):
    """An embedding worker already holds as many lookups waiting for their ID features as it
    allows; answered before anything was done, so the caller may simply ask again."""

    grpc_status = "RESOURCE_EXHAUSTED"


class ServersMisplaced(PersiaError):
    """A static PS address list (``infer_config.servers``) that does not match the replicas
    behind it: a replica at the wrong position, or a list of the wrong length. IDs would go to
    replicas that do not own them and read as zeros, so nothing is looked up until it matches."""

    grpc_status = "FAILED_PRECONDITION"


class EmbeddingLayoutMismatch(ServersMisplaced):
    """The PS replicas serve a checkpoint trained with another embedding layout than this
    worker's ``embedding_config.yml`` (a slot's index prefix, dim or hash stacking differs: slots
    listed in another order, another ``feature_index_prefix_bit`` or ``feature_groups``). Every
    lookup would miss and read zeros, so nothing is looked up until the configs match. A
    ``ServersMisplaced``: a misconfiguration that waiting does not heal (FAILED_PRECONDITION)."""


def answered_with(exc: BaseException, error: type[PersiaError]) -> bool:
    """Whether ``exc`` is a peer's answer carrying ``error`` (it travels as its ``grpc_status``)."""
    return isinstance(exc, RemoteError) and exc.kind == getattr(error, "grpc_status", None)
