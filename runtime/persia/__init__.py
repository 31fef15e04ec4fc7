"""PERSIA's runtime (docs/architecture.md).

gRPC's fork support, on by default in grpcio, restarts gRPC's poller threads in a forked child. A
child that runs Python between fork and exec (``subprocess``'s ``preexec_fn``, which
``persia.procs.spawn`` uses so that children die with their parent) then aborted about one time in
twenty, its poller finding its descriptor closed before the exec ("epoll_wait error: Bad file
descriptor"). Every child PERSIA starts execs, and none uses gRPC after a bare fork, so it is off
unless the environment says otherwise; it must be set before gRPC is imported, hence here.
"""

import os as _os

_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
