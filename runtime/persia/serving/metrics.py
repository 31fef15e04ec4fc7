"""The model server's Prometheus metrics, in a registry of its own (served at ``/metrics`` on the
HTTP port; several servers in one process, as in tests, do not collide).

=========================================== ==========================================================
``persia_serving_requests_total``           requests answered, by ``protocol`` (http, grpc) and ``code``
``persia_serving_request_latency_seconds``  histogram: request received (HTTP: its request line read)
                                            -> answer ready, by ``protocol``
``persia_serving_batch_size``               histogram: samples per model call (after batching; at
                                            most max_batch_size: a larger request, once per chunk)
``persia_serving_samples_total``            samples predicted
``persia_serving_errors_total``             failed requests by ``kind`` (bad_request, overloaded,
                                            unavailable (a server stopping too), internal, timeout)
``persia_serving_queue_depth``              requests waiting for a batch
``persia_serving_model_loads_total``        model (re)loads by ``result`` (ok, failed, refused: it
                                            does not take what the served model takes)
``persia_serving_model_loaded_timestamp_seconds`` when the served model was loaded
``persia_serving_model_reload_refused``     1 while the newest model file is refused (the old serves)
``persia_serving_ready``                    1 when ready (model loaded, embedding workers answer)
``persia_serving_embedding_worker_ready``   by ``embedding_worker`` (address): 1 when its ``Ready``
                                            answered ready at the last readiness check
``persia_serving_http_connections``         HTTP connections open (at most max_connections)
=========================================== ==========================================================

Every series also carries ``persia_job`` (:func:`persia.metrics.job_label`: ``PERSIA_JOB_NAME``, which
the operator sets on model-server pods), like the training roles' series, so that the dashboard's
job filter selects them. It is added when rendering, so the call sites name only their own labels.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from persia.metrics import JOB_LABEL, job_label

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
METRIC_NAMES = (
    "persia_serving_requests_total",
    "persia_serving_request_latency_seconds",
    "persia_serving_batch_size",
    "persia_serving_samples_total",
    "persia_serving_errors_total",
    "persia_serving_queue_depth",
    "persia_serving_model_loads_total",
    "persia_serving_model_loaded_timestamp_seconds",
    "persia_serving_ready",
    "persia_serving_http_connections",
    "persia_serving_model_reload_refused",
    "persia_serving_embedding_worker_ready",
)


class _WithJobLabel:
    """``registry``'s families with ``persia_job=job`` added to every sample."""

    def __init__(self, registry: CollectorRegistry, job: str):
        self.registry = registry
        self.job = job

    def collect(self):
        for family in self.registry.collect():  # fresh family objects on every collect
            family.samples = [s._replace(labels={**s.labels, JOB_LABEL: self.job}) for s in family.samples]
            yield family


class ServingMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.job = job_label()
        self.requests = Counter("persia_serving_requests", "requests answered", ["protocol", "code"], registry=r)
        self.latency = Histogram("persia_serving_request_latency_seconds", "request latency", ["protocol"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("persia_serving_batch_size", "samples per model call",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.samples = Counter("persia_serving_samples", "samples predicted", registry=r)
        self.errors = Counter("persia_serving_errors", "failed requests", ["kind"], registry=r)
        self.queue_depth = Gauge("persia_serving_queue_depth", "requests waiting for a batch", registry=r)
        self.model_loads = Counter("persia_serving_model_loads", "model loads", ["result"], registry=r)
        self.model_loaded = Gauge("persia_serving_model_loaded_timestamp_seconds", "when the model was loaded",
                                  registry=r)
        self.ready = Gauge("persia_serving_ready", "1 when ready", registry=r)
        self.http_connections = Gauge("persia_serving_http_connections", "HTTP connections open", registry=r)
        self.model_refused = Gauge("persia_serving_model_reload_refused",
                                   "1 while the newest model file is refused (the old model serves)", registry=r)
        self.embedding_worker_ready = Gauge("persia_serving_embedding_worker_ready",
                                            "1 when the embedding worker answered ready at the last check",
                                            ["embedding_worker"], registry=r)

    def render(self) -> bytes:
        return generate_latest(_WithJobLabel(self.registry, self.job))
