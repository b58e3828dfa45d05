"""A running request holds its prompt once: as the parsed request, never as bytes.

The client's body and the engine's request body are bytes as long as the prompt; a stream lives
for its whole decode. Holding either for that long doubled or tripled the memory of every
running request (the admission benchmark measured 108 MB for 1,024 held requests on the code
trace, 77 MB once neither was held).
"""

from __future__ import annotations

import gc
from typing import Any

import httpx
import orjson
import trio

from narwhal.config import AdmissionConfig
from narwhal.upstream.transport import OneShotBody
from tests.conftest import MODEL, StartFleet

MARKER = b"narwhal-memory-marker"


def sent_once(body: dict[str, Any]) -> dict[str, Any]:
    """httpx arguments for ``body`` that the test's own client does not keep."""
    raw = orjson.dumps(body)
    headers = {"content-type": "application/json", "content-length": str(len(raw))}
    return {"content": OneShotBody(raw), "headers": headers}


def bytes_holding_marker() -> int:
    """Bytes objects that hold the marker and are referred to by any tracked object."""
    gc.collect()
    found = {
        id(referent)
        for holder in gc.get_objects()
        for referent in gc.get_referents(holder)
        if type(referent) is bytes and MARKER in referent and referent is not MARKER
    }
    return len(found)


async def test_a_running_stream_holds_no_bytes_of_its_prompt(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    prompt = (MARKER.decode() + " ") * 200
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "narwhal_sim": {"output_tokens": 50, "itl_s": 1.0},
    }
    with trio.fail_after(120):
        request = sent_once(body)
        async with fleet.client.stream("POST", "/v1/chat/completions", **request) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            while "content" not in await anext(lines):
                pass
            # Decoding, 49 tokens to go: the request is held by the router.
            assert fleet.router.in_flight() == 1
            assert bytes_holding_marker() == 0
            async for _ in lines:
                pass
    fleet.assert_quiescent()


async def test_a_queued_request_holds_no_bytes_of_its_prompt(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    """Waiting for a prefill slot, too: only the parsed request is kept."""
    fleet = await start_fleet(admission=AdmissionConfig(mode="open", prefill_concurrency=1))
    slow = {"narwhal_sim": {"ttft_s": 5.0, "output_tokens": 1}}
    content = (MARKER.decode() + " ") * 200
    results: list[httpx.Response] = []

    async def one(text: str) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], **slow}
        request = sent_once(body)
        del body
        results.append(await fleet.client.post("/v1/chat/completions", **request))

    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            for _ in range(3):  # two engines, one prefill slot each: the third waits
                nursery.start_soon(one, content)
            await trio.sleep(1)
            assert fleet.router.queue.waiting(), "a request should be waiting"
            assert bytes_holding_marker() == 0
    assert [response.status_code for response in results] == [200, 200, 200]
    fleet.assert_quiescent()
