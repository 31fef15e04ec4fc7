"""kopf handlers: settings, login, child indexes, and the reconcile triggers.

All handlers are thin: create/resume/update(spec) and a periodic loop call the same
idempotent Reconciler pass; the indexes keep compact summaries of every child (pods
included) so that a pass needs no list calls. Handlers return nothing (kopf would store
return values in the status).

The periodic pass is a loop over an index of PersiaJobs, not a kopf timer: kopf puts a
finalizer on every object with a timer or daemon, and a finalizer is what strands jobs
when the operator is uninstalled. Without one, deleting a job needs no operator (owner
references remove its children).

`register()` builds everything on a given registry, so tests run a fresh operator per
test; `persia_operator.kopf_app` registers on kopf's default registry for `kopf run`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import kopf

from . import constants as C
from .children import summarize
from .config import OperatorConfig
from .events import JobEvent
from .kube import ApiError, KubeApi
from .natswatch import NatsWatcher
from .reconciler import Reconciler, event_manifest, managed_here

# Child kinds the operator watches: (kind, group, version, plural).
CHILD_RESOURCES = (
    ("Pod", "", "v1", "pods"),
    ("StatefulSet", "apps", "v1", "statefulsets"),
    ("Job", "batch", "v1", "jobs"),
    ("Deployment", "apps", "v1", "deployments"),
    ("Service", "", "v1", "services"),
    ("ConfigMap", "", "v1", "configmaps"),
)
INDEX_IDS = tuple(f"persia_{plural}" for _, _, _, plural in CHILD_RESOURCES)

LoginFn = Callable[..., kopf.ConnectionInfo | None]
JobKey = tuple[str, str]  # (namespace, name)


def default_login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account or kubeconfig, through the kubernetes client if it is
    installed (it knows exec/auth plugins), else kopf's own readers."""
    try:
        info = kopf.login_via_client(**kwargs)
    except (ImportError, kopf.LoginError):
        info = None
    return info or kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def apply_settings(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    settings.persistence.finalizer = C.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=C.ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=C.ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.watching.server_timeout = config.watch_server_timeout
    settings.watching.client_timeout = config.watch_client_timeout
    settings.watching.connect_timeout = config.watch_connect_timeout
    settings.networking.request_timeout = config.request_timeout
    # Resources are discovered once at start-up; the CRD is installed before the operator
    # (Helm crds/), and no namespace/CRD list+watch permission is needed.
    settings.scanning.disabled = True
    settings.posting.reporting_component = C.MANAGED_BY
    settings.posting.event_name_prefix = f"{C.MANAGED_BY}-"
    settings.peering.standalone = config.standalone
    for _, group, version, plural in CHILD_RESOURCES:
        gv = f"{group}/{version}" if group else version
        settings.watching.label_selectors[gv, plural] = C.LABEL_JOB


def collect_summaries(indexes: dict[str, Any], namespace: str, name: str) -> list[dict[str, Any]]:
    summaries: list[dict[str, Any]] = []
    for index_id in INDEX_IDS:
        index = indexes.get(index_id)
        if index is not None and (namespace, name) in index:
            summaries += list(index[(namespace, name)])
    return summaries


def job_version(indexes: dict[str, Any], namespace: str, name: str) -> str | None:
    """The job's resourceVersion as kopf's index last saw it."""
    store = (indexes.get("persia_persiajobs") or {}).get((namespace, name))
    return next(iter(store), None) if store is not None else None


def failed_passes(keys: Sequence[JobKey], results: Sequence[object]) -> dict[JobKey, Exception]:
    """The jobs whose pass raised, with the error: gather(return_exceptions=True) puts
    errors in place of results without saying whose they are, and an error no one
    names means a job silently no longer reconciled."""
    return {key: result for key, result in zip(keys, results, strict=True) if isinstance(result, Exception)}


def failure_event(err: BaseException) -> JobEvent:
    """The Warning event on a job whose periodic pass fails (`kubectl describe pj`):
    the error's type and first line only (the traceback is in the operator's log)."""
    first = (str(err).strip().splitlines() or [""])[0]
    message = f"Reconcile failed, retried every pass: {type(err).__name__}: {first}"
    return JobEvent("Warning", "ReconcileFailed", message[:1024])


PASS_TIMEOUT_S = 60.0  # a job's periodic pass is cut short after this (reported like any failure)
API_ERRORS_BEFORE_EVENT = 3  # consecutive passes ending in an API error before the job shows it


def api_error_streaks(prev: Mapping[JobKey, int], keys: Sequence[JobKey], results: Sequence[object]) -> dict[JobKey, int]:
    """Consecutive passes per job that ended in an API error (returned, not raised: a
    transient one is only logged). One that persists (403 until RBAC is fixed, a status the
    server refuses, an API that stays down) must show on the job, not only in the log."""
    return {key: prev.get(key, 0) + 1 for key, result in zip(keys, results, strict=True) if isinstance(result, ApiError)}


def events_due(reported: Mapping[JobKey, str], failing: Mapping[JobKey, str]) -> list[JobKey]:
    """Jobs whose failure is news (a first failure, or a different error): one event
    each, not one per pass every reconcile_interval."""
    return [key for key, message in failing.items() if reported.get(key) != message]


def _make_indexer(kind: str) -> Callable[..., dict[tuple[str, str], dict[str, Any]]]:
    def indexer(namespace: str, labels: dict[str, str], body: Any, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
        return {(namespace, labels[C.LABEL_JOB]): summarize(kind, body)}

    return indexer


def register(
    registry: kopf.OperatorRegistry,
    config: OperatorConfig,
    login: LoginFn = default_login,
) -> Reconciler:
    """Register every handler on `registry`; return the Reconciler (for probes/tests)."""
    login_kwargs: dict[str, Any] = {}

    def relogin() -> kopf.ConnectionInfo | None:
        return login(**login_kwargs) if login_kwargs else None

    api = KubeApi(login=relogin, request_timeout=config.request_timeout)
    reconciler = Reconciler(api, nats=NatsWatcher(interval=config.nats_probe_interval))

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        apply_settings(settings, config)

    @kopf.on.login(registry=registry)
    def login_handler(**kwargs: Any) -> kopf.ConnectionInfo | None:
        login_kwargs.update(logger=kwargs.get("logger"), settings=kwargs.get("settings"))
        info = login(**kwargs)
        if info is not None:
            reconciler.api.set_connection(info)
        return info

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        await reconciler.close()

    jobs_ready = asyncio.Event()  # kopf runs resource handlers only once indexes are filled

    @kopf.index(C.GROUP, C.VERSION, C.PLURAL, id="persia_persiajobs", registry=registry)
    def index_job(namespace: str, name: str, meta: Any, body: Any, **_: Any) -> dict[tuple[str, str], str | None]:
        """The job's resourceVersion: a finished job is read again only once it changes. A job of
        another controller (spec.managedBy) is not in it: the periodic loop read every such job
        every round, only to find it was not this operator's."""
        if not managed_here(body):
            return {}
        return {(namespace, name): meta.get("resourceVersion")}

    @kopf.on.startup(registry=registry)
    async def start_periodic(**kwargs: Any) -> None:
        loop_task = asyncio.get_running_loop().create_task(periodic(kwargs), name="persia-periodic-reconcile")
        background.append(loop_task)

    background: list[asyncio.Task[None]] = []

    async def periodic(indexes: dict[str, Any]) -> None:
        """Every reconcile_interval, a pass over every known job (a few at a time)."""
        await jobs_ready.wait()
        limit = asyncio.Semaphore(8)
        log = logging.getLogger("persia_operator")

        async def one(namespace: str, name: str) -> ApiError | None:
            summaries = collect_summaries(indexes, namespace, name)
            if not reconciler.periodic_pass_due(namespace, name, job_version(indexes, namespace, name), summaries):
                return None  # finished, and nothing changed since its last pass: no call
            async with limit:
                try:
                    # bounded: the round waits for its slowest pass, so one job whose calls hang
                    # (a webhook timing out on every create) held up every other job's failures,
                    # restarts and deadlines. A pass cut short is safe: it saves its status first.
                    await asyncio.wait_for(
                        reconciler.reconcile(namespace, name, collect_summaries(indexes, namespace, name), log),
                        PASS_TIMEOUT_S,
                    )
                except ApiError as err:  # transient until it persists (api_error_streaks)
                    log.warning(f"Reconcile of {namespace}/{name} failed, will retry: {err}")
                    return err
                return None

        reported: dict[JobKey, str] = {}  # event message last posted per failing job
        streaks: dict[JobKey, int] = {}  # consecutive passes per job that ended in an API error
        while True:
            await asyncio.sleep(config.reconcile_interval)
            keys = list(indexes.get("persia_persiajobs") or {})
            reconciler.keep_only(set(keys))  # deleted jobs: their NATS probes, gauge entries, locks
            results = await asyncio.gather(*(one(ns, name) for ns, name in keys), return_exceptions=True)
            streaks = api_error_streaks(streaks, keys, results)
            failures = failed_passes(keys, [None if isinstance(r, ApiError) else r for r in results])
            for (namespace, name), err in failures.items():
                # Also counted (by the Reconciler) in persia_operator_reconcile_total{result="error"}.
                log.error(f"Reconcile of {namespace}/{name} failed, will retry next pass: {err!r}", exc_info=err)
            by_key = dict(zip(keys, results, strict=True))
            failures.update({key: by_key[key] for key, n in streaks.items() if n >= API_ERRORS_BEFORE_EVENT})
            failing = {key: failure_event(err).message for key, err in failures.items()}
            for key in events_due(reported, failing):
                if not await post_failure_event(key, failure_event(failures[key]), log):
                    failing.pop(key)  # not posted: try again next pass
            reported = failing  # a job that passes again (or is gone) is forgotten

    async def post_failure_event(key: JobKey, event: JobEvent, log: logging.Logger) -> bool:
        """Best effort: the log has the error; the event shows it on the job."""
        namespace, name = key
        try:
            body = await reconciler.api.get(C.KIND, namespace, name)
            if body is None:
                return True  # deleted: nothing to report on
            await reconciler.api.create(event_manifest(body, event, reconciler.clock()))
        except Exception as err:
            log.warning(f"Could not post a {event.reason} event on {namespace}/{name}: {err!r}")
            return False
        return True

    @kopf.on.probe(id="reconcile_passes", registry=registry)
    def passes(**_: Any) -> int:
        return reconciler.passes

    for kind, group, version, plural in CHILD_RESOURCES:
        gv = f"{group}/{version}" if group else version
        kopf.index(gv, plural, id=f"persia_{plural}", labels={C.LABEL_JOB: kopf.PRESENT},
                   registry=registry)(_make_indexer(kind))  # fmt: skip

    async def reconcile(namespace: str, name: str, logger: Any, kwargs: dict[str, Any]) -> None:
        try:
            await reconciler.reconcile(namespace, name, collect_summaries(kwargs, namespace, name), logger)
        except ApiError as err:
            # Transient (network, 5xx, 403 until RBAC is fixed): the timer tries again.
            logger.warning(f"Reconcile of {namespace}/{name} failed, will retry: {err}")

    resource = (C.GROUP, C.VERSION, C.PLURAL)

    def ours(body: Any, **_: Any) -> bool:
        """Not a job of another controller: its events are not even read."""
        return managed_here(body)

    @kopf.on.create(*resource, id="reconcile-on-create", when=ours, registry=registry)
    @kopf.on.resume(*resource, id="reconcile-on-resume", when=ours, registry=registry)
    @kopf.on.update(*resource, field="spec", id="reconcile-on-update", when=ours, registry=registry)
    async def on_change(namespace: str, name: str, logger: Any, **kwargs: Any) -> None:
        jobs_ready.set()
        await reconcile(namespace, name, logger, kwargs)

    @kopf.on.cleanup(registry=registry)
    async def stop_periodic(**_: Any) -> None:
        for task in background:
            task.cancel()

    return reconciler


def run_kwargs(config: OperatorConfig) -> dict[str, Any]:
    """Arguments of kopf.run/kopf.operator for this configuration."""
    kwargs: dict[str, Any] = {
        "standalone": config.standalone,
        "priority": config.priority,
        "liveness_endpoint": config.liveness,
        "clusterwide": config.clusterwide,
        "namespaces": config.namespaces,
    }
    if config.peering_name:
        kwargs["peering_name"] = config.peering_name
    return kwargs

