"""The operator's API client tries a call again after a transient failure: the pure rule
(`retry_delay`) and the client's loop over a scripted `_request_once`.

What a script cannot check: real connection resets and a real API server's Retry-After; the
KMock tests run the client against a server."""

from __future__ import annotations

import pytest

from persia_operator import kube
from persia_operator.kube import MAX_RETRY_AFTER_S, RETRY_DELAYS_S, ApiError, KubeApi, retry_delay


@pytest.mark.parametrize("err, retried", [
    (ApiError(None, "ServerDisconnectedError", "the server closed the connection"), True),
    (ApiError(503, "ServiceUnavailable", "apiserver restarting"), True),
    (ApiError(500, "InternalError", "etcd leader changed"), True),
    (ApiError(429, "TooManyRequests", "throttled"), True),
    (ApiError(None, "Timeout", "GET /x timed out"), False),  # a second one would double the stall
    (ApiError(None, "NotLoggedIn", "no credentials yet"), False),
    (ApiError(404, "NotFound", "gone"), False),
    (ApiError(409, "AlreadyExists", "exists"), False),
    (ApiError(422, "Invalid", "spec.replicas"), False),
    (ApiError(403, "Forbidden", "RBAC"), False),
])  # fmt: skip
def test_only_transient_failures_are_tried_again(err, retried):
    assert (retry_delay(err, 0) is not None) is retried
    assert retry_delay(err, len(RETRY_DELAYS_S)) is None  # two retries, then the error stands


def test_a_throttled_call_waits_its_retry_after_up_to_a_bound():
    assert retry_delay(ApiError(429, "TooManyRequests", "", retry_after_s=3), 0) == 3
    assert retry_delay(ApiError(429, "TooManyRequests", "", retry_after_s=600), 0) == MAX_RETRY_AFTER_S
    assert retry_delay(ApiError(429, "TooManyRequests", ""), 1) == RETRY_DELAYS_S[1]
    assert kube._seconds("2") == 2 and kube._seconds("Wed, 21 Oct 2015 07:28:00 GMT") is None


class Scripted(KubeApi):
    """`_request_once` answers from a script: an ApiError to raise, or a body to return."""

    def __init__(self, script):
        super().__init__(login=None)
        self.script, self.calls = list(script), 0

    async def _request_once(self, method, path, body=None, content_type="application/json", params=None):
        self.calls += 1
        answer = self.script.pop(0)
        if isinstance(answer, ApiError):
            raise answer
        return answer


async def test_a_call_that_fails_transiently_is_tried_again(monkeypatch):
    slept: list[float] = []

    async def sleep(seconds):
        slept.append(seconds)

    monkeypatch.setattr(kube.asyncio, "sleep", sleep)
    busy = ApiError(503, "ServiceUnavailable", "apiserver restarting")
    api = Scripted([busy, busy, {"metadata": {"name": "demo"}}])
    assert await api.get("ConfigMap", "ns1", "demo") == {"metadata": {"name": "demo"}}
    assert api.calls == 3 and len(slept) == 2 and 0.8 * RETRY_DELAYS_S[0] <= slept[0] <= 1.2 * RETRY_DELAYS_S[0]
    api = Scripted([busy, busy, busy])  # still failing after two retries: the error stands
    with pytest.raises(ApiError, match="503"):
        await api.get("ConfigMap", "ns1", "demo")
    api = Scripted([ApiError(422, "Invalid", "spec")])  # not transient: at once
    with pytest.raises(ApiError, match="422"):
        await api.create({"kind": "ConfigMap", "apiVersion": "v1", "metadata": {"name": "x", "namespace": "ns1"}})
    assert api.calls == 1
