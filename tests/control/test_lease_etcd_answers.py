"""The etcd store's answers, odd ones included, through a fake gateway (httpx.MockTransport):
no etcd needed."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable

import httpx
import pytest

from narwhal.control.etcd import EtcdStore
from narwhal.control.lease import Leader, LeaseStoreError

Handler = Callable[[httpx.Request], httpx.Response]


def _store(handler: Handler, endpoints: tuple[str, ...] = ("http://etcd-1:2379",)) -> EtcdStore:
    return EtcdStore(
        endpoints, "pair/leader", timeout_s=1.0, transport=httpx.MockTransport(handler)
    )


def _json(body: object, status: int = 200) -> httpx.Response:
    return httpx.Response(status, content=json.dumps(body).encode())


async def test_requests_are_the_gateways_shapes() -> None:
    seen: list[tuple[str, dict[str, object]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if request.url.path == "/v3/lease/grant":
            return _json({"header": {"revision": "1"}, "ID": "77", "TTL": "2"})
        if request.url.path == "/v3/kv/txn":
            return _json({"header": {"revision": "9"}, "succeeded": True})
        return _json({"result": {"ID": "77", "TTL": "2"}})

    store = _store(handler)
    try:
        grant = await store.grant(1.5)
        assert (grant.id, grant.ttl_s) == (77, 2.0)
        assert await store.keep_alive(77) == 2.0
        leader = await store.campaign(77, "router a")
        assert leader == Leader(77, 9, 9, "router a")
    finally:
        await store.aclose()
    key = base64.b64encode(b"pair/leader").decode()
    assert seen[0] == ("/v3/lease/grant", {"TTL": 2})  # whole seconds, rounded up
    assert seen[1] == ("/v3/lease/keepalive", {"ID": "77"})
    path, txn = seen[2]
    assert path == "/v3/kv/txn"
    assert txn["compare"] == [
        {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
    ]
    value = base64.b64encode(b"router a").decode()
    assert txn["success"] == [{"request_put": {"key": key, "value": value, "lease": "77"}}]


async def test_a_lost_campaign_names_the_holder() -> None:
    value = base64.b64encode(b"router b").decode()

    def handler(request: httpx.Request) -> httpx.Response:
        kv = {"create_revision": "4", "lease": "12", "value": value}
        return _json(
            {"header": {"revision": "8"}, "responses": [{"response_range": {"kvs": [kv]}}]}
        )

    store = _store(handler)
    try:
        assert await store.campaign(77, "router a") == Leader(12, 4, 8, "router b")
    finally:
        await store.aclose()


@pytest.mark.parametrize(
    ("path", "answer", "message"),
    [
        ("/v3/lease/grant", httpx.Response(200, content=b"not json"), "without a JSON object"),
        ("/v3/lease/grant", _json({"ID": "0"}), "granted no lease"),
        ("/v3/lease/grant", _json({"ID": "x1", "TTL": "1"}), "malformed number"),
        ("/v3/lease/keepalive", _json({"header": {}}), "without a result"),
        ("/v3/kv/txn", _json({"succeeded": True}), "without a revision"),
        ("/v3/kv/txn", _json({"header": {"revision": "3"}}), "without the leader key"),
        (
            "/v3/kv/txn",
            _json({"error": "etcdserver: requested lease not found", "code": 5}, 404),
            "answered 404",
        ),
        ("/v3/lease/grant", _json({"message": "boom"}, 500), "answered 500"),
    ],
)
async def test_odd_answers_are_store_errors(
    path: str, answer: httpx.Response, message: str
) -> None:
    store = _store(lambda request: answer)
    try:
        with pytest.raises(LeaseStoreError, match=message):
            if path == "/v3/lease/grant":
                await store.grant(1)
            elif path == "/v3/lease/keepalive":
                await store.keep_alive(1)
            else:
                await store.campaign(1, "a")
    finally:
        await store.aclose()


async def test_an_expired_lease_renews_to_zero_and_revokes_quietly() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v3/lease/revoke":
            return _json({"error": "etcdserver: requested lease not found", "code": 5}, 404)
        return _json({"result": {"ID": "5"}})  # no TTL: the lease is gone

    store = _store(handler)
    try:
        assert await store.keep_alive(5) == 0.0
        await store.revoke(5)
    finally:
        await store.aclose()


async def test_the_next_endpoint_answers_when_one_is_down() -> None:
    hosts: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)
        if request.url.host == "etcd-1":
            raise httpx.ConnectError("connection refused", request=request)
        return _json({"result": {"ID": "5", "TTL": "3"}})

    store = _store(handler, ("http://etcd-1:2379", "http://etcd-2:2379/"))
    try:
        assert await store.keep_alive(5) == 3.0
        assert await store.keep_alive(5) == 3.0  # it stays on the one that answered
    finally:
        await store.aclose()
    assert hosts == ["etcd-1", "etcd-2", "etcd-2"]


async def test_watch_ends_at_the_first_event_and_on_errors() -> None:
    lines = [
        {"result": {"header": {"revision": "5"}, "created": True}},
        {"result": {"events": [{"type": "DELETE"}]}},
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["create_request"]["start_revision"] == "6"
        return httpx.Response(200, content=b"\n".join(json.dumps(x).encode() for x in lines))

    store = _store(handler)
    try:
        await store.watch(Leader(1, 2, 5, "a"))
        lines[1] = {"error": {"grpc_code": 14, "message": "unavailable"}}
        with pytest.raises(LeaseStoreError, match="ended the watch"):
            await store.watch(Leader(1, 2, 5, "a"))
    finally:
        await store.aclose()
