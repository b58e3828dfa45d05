"""The lease store on a real etcd, through its v3 JSON gateway (``/v3/...``) over httpx.

No etcd client library: five calls of the gateway are all the :class:`LeaseKeeper` needs.

- ``POST /v3/lease/grant`` ``{"TTL": n}``: a lease; etcd answers the TTL it enforces (whole
  seconds, at least its minimum).
- ``POST /v3/lease/keepalive`` ``{"ID": id}``: one renewal per call (the gateway ends the
  stream when the request body ends); an answer without ``TTL`` means the lease is gone.
- ``POST /v3/kv/txn``: if the leader key's ``create_revision`` is 0 (it is absent), put it
  under our lease, else read it. Either way the answer names the holder's lease and the key's
  ``create_revision`` (the fencing token; on success, the transaction's revision).
- ``POST /v3/watch`` ``{"create_request": {"key", "start_revision"}}``: a stream of JSON lines;
  the first event on the key after the revision we read ends the wait.
- ``POST /v3/lease/revoke``: a graceful shutdown gives the lease up, which deletes the key.

The leader key is ``<control.cluster>/leader``; keys and values travel base64-encoded, int64
fields as strings. Endpoints (``control.etcd_endpoints``) are tried in turn: a request that
cannot connect, or times out, goes to the next.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import math
from collections.abc import Sequence
from typing import Any

import httpx
import orjson

from narwhal.control.lease import Grant, Leader, LeaseStoreError
from narwhal.upstream.transport import OneShotBody

__all__ = ["EtcdStore", "leader_key"]

log = logging.getLogger(__name__)


def leader_key(cluster: str) -> str:
    """The leader key of a router pair (``control.cluster``)."""
    return f"{cluster}/leader"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode("ascii")


def _int(value: object, default: int = 0) -> int:
    """An int64 field as the gateway writes it (a string, or absent when zero)."""
    if value is None:
        return default
    if isinstance(value, int | str):
        try:
            return int(value)
        except ValueError:
            pass
    raise LeaseStoreError(f"etcd sent a malformed number: {str(value)[:40]!r}")


class EtcdStore:
    """A :class:`~narwhal.control.lease.LeaseStore` on etcd.

    Args:
        endpoints: ``http://HOST:PORT`` of the etcd members.
        key: the leader key (:func:`leader_key`).
        timeout_s: the longest one request may take (connect, write, read); the watch's stream
            may stay silent for any time.
        transport: an httpx transport (tests).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        key: str,
        *,
        timeout_s: float,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        self._endpoints = [endpoint.rstrip("/") for endpoint in endpoints]
        self._index = 0
        self._key = _b64(key)
        self._timeout = httpx.Timeout(timeout_s)
        self._http = httpx.AsyncClient(timeout=self._timeout, transport=transport)

    async def aclose(self) -> None:
        """Close the connections."""
        await self._http.aclose()

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to one endpoint after another until one answers.

        Raises:
            LeaseStoreError: none answered, or etcd refused the request.
        """
        content = orjson.dumps(body)
        failure = "no endpoint"
        for _ in self._endpoints:
            endpoint = self._endpoints[self._index]
            try:
                response = await self._http.send(self._request(endpoint + path, content))
            except httpx.HTTPError as exc:
                failure = f"{endpoint}: {type(exc).__name__}"
                self._index = (self._index + 1) % len(self._endpoints)
                continue
            return _answer(path, response.status_code, response.content)
        raise LeaseStoreError(f"etcd unreachable ({failure})")

    async def grant(self, ttl_s: float) -> Grant:
        """A new lease of ``ttl_s`` rounded up to whole seconds (etcd's unit)."""
        data = await self._call("/v3/lease/grant", {"TTL": max(1, math.ceil(ttl_s))})
        lease_id, ttl = _int(data.get("ID")), _int(data.get("TTL"))
        if lease_id == 0 or ttl <= 0:
            raise LeaseStoreError("etcd granted no lease")
        return Grant(lease_id, float(ttl))

    async def keep_alive(self, lease_id: int) -> float:
        """Renew the lease; its TTL from now, 0 when etcd no longer has it."""
        data = await self._call("/v3/lease/keepalive", {"ID": str(lease_id)})
        result = data.get("result")
        if not isinstance(result, dict):
            raise LeaseStoreError("etcd sent a keep-alive answer without a result")
        return float(max(0, _int(result.get("TTL"))))

    async def campaign(self, lease_id: int, value: str) -> Leader:
        """Create the leader key under ``lease_id`` if absent, in one transaction."""
        key = self._key
        absent = {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        put = {"key": key, "value": _b64(value), "lease": str(lease_id)}
        data = await self._call(
            "/v3/kv/txn",
            {
                "compare": [absent],
                "success": [{"request_put": put}],
                "failure": [{"request_range": {"key": key}}],
            },
        )
        header = data.get("header")
        revision = _int(header.get("revision")) if isinstance(header, dict) else 0
        if revision <= 0:
            raise LeaseStoreError("etcd sent a transaction answer without a revision")
        if data.get("succeeded") is True:
            return Leader(lease_id, revision, revision, value)
        try:
            kv = data["responses"][0]["response_range"]["kvs"][0]
            held = base64.b64decode(kv.get("value", ""), validate=True).decode(errors="replace")
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            # The key vanished between the comparison and the read cannot happen in one
            # transaction: anything else is a broken answer.
            raise LeaseStoreError("etcd sent a transaction answer without the leader key") from exc
        return Leader(_int(kv.get("lease")), _int(kv.get("create_revision")), revision, held)

    def _request(
        self, url: str, body: bytes, *, timeout: httpx.Timeout | None = None
    ) -> httpx.Request:
        """A POST of ``body`` to ``url`` whose body is no async generator: httpx wraps every
        ``content`` in one, and a send that fails half way (etcd gone) abandons it to the
        garbage collector, which reports it."""
        request = self._http.build_request(
            "POST",
            url,
            content=body,
            headers={"content-type": "application/json"},
            timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout,
        )
        request.stream = OneShotBody(body)
        return request

    async def watch(self, leader: Leader) -> None:
        """Return at the first event on the leader key after ``leader.revision``."""
        body = orjson.dumps(
            {"create_request": {"key": self._key, "start_revision": str(leader.revision + 1)}}
        )
        endpoint = self._endpoints[self._index]
        timeout = httpx.Timeout(self._timeout.connect, read=None)
        try:
            request = self._request(endpoint + "/v3/watch", body, timeout=timeout)
            async with contextlib.aclosing(await self._http.send(request, stream=True)) as response:
                if response.status_code != 200:
                    raise LeaseStoreError(f"etcd answered {response.status_code} to a watch")
                async for line in response.aiter_lines():
                    if line.strip() and _watch_ended(line):
                        return
        except httpx.HTTPError as exc:
            self._index = (self._index + 1) % len(self._endpoints)
            raise LeaseStoreError(f"etcd watch failed ({endpoint}: {type(exc).__name__})") from exc

    async def revoke(self, lease_id: int) -> None:
        """Give the lease up; a lease etcd no longer has is already given up."""
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease_id)})
        except _NotFound:
            pass


class _NotFound(LeaseStoreError):
    """etcd answered 404 (a lease it does not have)."""


def _answer(path: str, status: int, content: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise LeaseStoreError(f"etcd answered {status} to {path} without a JSON object")
    if status != 200 or "error" in data:
        message = str(data.get("message") or data.get("error") or "")[:200]
        error = _NotFound if status == 404 else LeaseStoreError
        raise error(f"etcd answered {status} to {path}: {message}")
    return data


def _watch_ended(line: str) -> bool:
    """Whether one line of a watch's stream ends the wait (an event, or the watch is over).

    Raises:
        LeaseStoreError: the line is an error, or not JSON.
    """
    try:
        message = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise LeaseStoreError("etcd sent a watch line that is not JSON") from exc
    if not isinstance(message, dict) or "error" in message:
        raise LeaseStoreError("etcd ended the watch with an error")
    result = message.get("result")
    if not isinstance(result, dict):
        return False
    return bool(result.get("events")) or result.get("canceled") is True
