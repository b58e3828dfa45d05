"""What a client gets through Narwhal equals what vLLM 0.32 itself would have answered.

Ground truth: the real vLLM 0.32 answers in ``tests/sim/captures/`` (see its README). Three
parts:

* assembly: the router's non-streaming answer, assembled from a captured stream, equals the
  captured non-streaming answer value for value (ids and timestamps aside);
* chunks vLLM sends only because token IDs were asked for: a client that did not ask never sees
  them (the captured streams replayed through a router by an in-process stand-in for vLLM);
* requests whose answer a stream or token IDs would change go to the engine as the client sent
  them: non-streaming ones through the non-streaming upstream path, with placement, the retry,
  the deadline, a client going away and the books as for a stream (simulated engines).
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import httpx
import orjson
import pytest
import trio

from narwhal.bench.inprocess import ASGIStreamTransport, run_lifespan
from narwhal.config import (
    AdmissionConfig,
    Config,
    MonitoringConfig,
    ServingConfig,
    UpstreamConfig,
)
from narwhal.protocol.assembly import Assembler
from narwhal.protocol.chunks import only_hidden_ids
from narwhal.protocol.requests import parse_request
from narwhal.scheduling.engines import Slot
from narwhal.upstream.dialects import (
    VLLM_CHAT,
    VLLM_CHAT_FORCED_TOOL,
    VLLM_COMPLETIONS,
    as_sent,
    plan_upstream,
    response_shape,
    streams_upstream,
)
from narwhal.upstream.profiling import PROBE_USER
from narwhal.web.app import create_app, get_router
from tests.conftest import MODEL, StartFleet, engine_config
from tests.sim.vllm_captures import capture
from tests.support import sse_payloads, until
from tests.test_health import faulty

# -- helpers ------------------------------------------------------------------------------------


def chunks_of(name: str) -> list[dict[str, Any]]:
    """A captured stream's chunks (``[DONE]`` left out)."""
    return [event for event in capture(name).events() if event != "[DONE]"]


def frames(text: str) -> list[Any]:
    return [p if p == "[DONE]" else orjson.loads(p) for p in sse_payloads(text)]


def without_identity(value: Any) -> Any:
    """``value`` without what differs between two answers to the same request: the response
    ``id``, ``created`` and the tool calls' ``id``."""
    value = copy.deepcopy(value)
    value.pop("id", None)
    value.pop("created", None)
    for choice in value.get("choices", ()):
        for call in (choice.get("message") or choice.get("delta") or {}).get("tool_calls") or ():
            call.pop("id", None)
    return value


def assemble(
    name: str, route: str, shape: Any, *, expose: bool = False, estimate: int = 1
) -> dict[str, Any]:
    assembler = Assembler(
        route,  # type: ignore[arg-type]
        expose_token_ids=expose,
        prompt_tokens_estimate=estimate,
        shape=shape,
    )
    for chunk in chunks_of(name):
        assembler.feed(copy.deepcopy(chunk))
    return assembler.result()


def request(route: str = "chat", **body: Any) -> Any:
    body.setdefault("model", MODEL)
    if route == "chat":
        body.setdefault("messages", [{"role": "user", "content": "Hello"}])
    else:
        body.setdefault("prompt", "Hello")
    return parse_request(orjson.dumps(body), route, MODEL)  # type: ignore[arg-type]


# -- assembly in vLLM's own shape ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("stream", "answer", "route", "shape"),
    [
        ("chat_stream_include_usage", "chat_nonstream", "chat", VLLM_CHAT),
        ("chat_stream_tool_named", "chat_nonstream_tool_named", "chat", VLLM_CHAT_FORCED_TOOL),
        (
            "completions_stream_logprobs",
            "completions_nonstream_logprobs",
            "completions",
            VLLM_COMPLETIONS,
        ),
    ],
)
def test_an_assembled_answer_equals_vllms_own_non_streaming_answer(
    stream: str, answer: str, route: str, shape: Any
) -> None:
    assembled = assemble(stream, route, shape)
    expected = capture(answer).json()
    assert without_identity(assembled) == without_identity(expected)
    # The same keys in the same order, at every level, as vLLM writes them.
    assert list(assembled) == list(expected)
    assert list(assembled["choices"][0]) == list(expected["choices"][0])
    assert list(assembled["usage"]) == list(expected["usage"])
    if route == "chat":
        assert list(assembled["choices"][0]["message"]) == list(expected["choices"][0]["message"])


def test_a_tool_call_answer_has_vllms_empty_content_not_null() -> None:
    assembled = assemble("chat_stream_tool_named", "chat", VLLM_CHAT_FORCED_TOOL)
    assert assembled["choices"][0]["message"]["content"] == ""
    assert capture("chat_nonstream_tool_named").json()["choices"][0]["message"]["content"] == ""
    # tool_choice "required" builds its message the same way (`content or ""`).
    required = assemble("chat_stream_tool_required", "chat", VLLM_CHAT_FORCED_TOOL)
    assert required["choices"][0]["message"]["content"] == ""
    assert required["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_tool_calls_and_reasoning_leave_the_content_null_as_vllms_parsers_do() -> None:
    # tool_choice auto: the hermes parser's content is `text before the call or None`.
    auto = assemble("chat_stream_tool_required", "chat", VLLM_CHAT)
    assert auto["choices"][0]["message"]["content"] is None
    assembler = Assembler("chat", expose_token_ids=False, prompt_tokens_estimate=1, shape=VLLM_CHAT)
    role, *_ = chunks_of("chat_stream_plain")
    thinking = copy.deepcopy(role)
    thinking["choices"][0]["delta"] = {"reasoning": "hm"}
    for chunk in (copy.deepcopy(role), thinking):
        assembler.feed(chunk)
    message = assembler.result()["choices"][0]["message"]
    assert (message["content"], message["reasoning"]) == (None, "hm")


def test_a_text_answer_with_no_text_is_an_empty_string_as_vllm_writes_it() -> None:
    role, *_, finish = chunks_of("chat_stream_plain")
    for shape, content in ((VLLM_CHAT, ""), (None, None)):
        assembler = Assembler("chat", expose_token_ids=False, prompt_tokens_estimate=1, shape=shape)
        for chunk in (role, finish):
            assembler.feed(copy.deepcopy(chunk))
        assert assembler.result()["choices"][0]["message"]["content"] == content


def test_token_ids_asked_for_by_the_client_fill_vllms_keys() -> None:
    assembled = assemble("chat_stream_token_ids", "chat", VLLM_CHAT, expose=True)
    expected = capture("chat_nonstream_token_ids_logprobs").json()
    # Another request (logprobs, three tokens): the same keys, the IDs where vLLM puts them.
    assert list(assembled) == list(expected)
    assert list(assembled["choices"][0]) == list(expected["choices"][0])
    assert assembled["prompt_token_ids"] == expected["prompt_token_ids"]
    assert assembled["choices"][0]["token_ids"] == [1320, 161, 1320, 161, 1320, 161]
    # Computed from the IDs (this stream had no usage chunk), with vLLM's usage keys.
    assert assembled["usage"] == {
        "prompt_tokens": 21,
        "total_tokens": 27,
        "completion_tokens": 6,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def test_other_dialects_keep_the_generic_shape() -> None:
    chat = request()
    assert response_shape("sglang", chat) is None
    assert response_shape("openai", chat) is None
    assert response_shape("vllm", chat) is VLLM_CHAT
    assert response_shape("vllm", request(tool_choice="required")) is VLLM_CHAT_FORCED_TOOL
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert response_shape("vllm", request(tool_choice=named)) is VLLM_CHAT_FORCED_TOOL
    assert response_shape("vllm", request(tool_choice="auto")) is VLLM_CHAT
    assert response_shape("vllm", request("completions")) is VLLM_COMPLETIONS
    generic = assemble("chat_stream_include_usage", "chat", None)
    assert "annotations" not in generic["choices"][0]["message"]
    assert "service_tier" not in generic
    assert generic["choices"][0]["logprobs"] is None


# -- requests that go as sent -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "fields", "reason", "streamed"),
    [
        ("chat", {"prompt_logprobs": 1}, "prompt_logprobs", False),
        ("completions", {"prompt_logprobs": 0}, "prompt_logprobs", False),
        ("completions", {"echo": True}, "echo", False),
        ("completions", {"echo": True, "stream": True}, "echo", True),
        ("chat", {"echo": True}, "echo", False),
        ("chat", {"echo": True, "stream": True}, "echo", True),
        ("chat", {"include_reasoning": False, "stream": True}, "include_reasoning", True),
        ("chat", {"include_reasoning": False}, "include_reasoning", False),
        ("chat", {"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params", False),
        ("completions", {"ec_transfer_params": {}}, "ec_transfer_params", False),
    ],
)
def test_requests_a_stream_or_token_ids_would_change_go_as_sent(
    route: str, fields: dict[str, Any], reason: str, streamed: bool
) -> None:
    parsed = request(route, max_tokens=3, **fields)
    assert as_sent(parsed) == reason
    assert streams_upstream(parsed) is streamed
    plan = plan_upstream(parsed, token_ids=True)
    assert orjson.loads(plan.body) == parsed.body
    assert (plan.stream, plan.token_ids, plan.as_sent) == (streamed, False, reason)
    assert not plan.exposure.hide_token_ids and not plan.exposure.drop_usage_chunk


def test_other_requests_are_streamed_with_what_the_router_needs() -> None:
    for parsed in (
        request(),
        request(echo=False, include_reasoning=True),
        # vLLM refuses prompt_logprobs on streams itself: the refusal reaches the client.
        request(stream=True, prompt_logprobs=1),
        request(stream=True, kv_transfer_params={"do_remote_decode": True}),
    ):
        assert as_sent(parsed) is None and streams_upstream(parsed)
        body = orjson.loads(plan_upstream(parsed, token_ids=True).body)
        assert body["stream"] is True and body["return_token_ids"] is True
        assert body["stream_options"] == {"include_usage": True}


# -- chunks that carry nothing but hidden token IDs ---------------------------------------------


def test_chunks_vllm_sends_only_for_token_ids_are_recognised() -> None:
    kinds = [only_hidden_ids(chunk) for chunk in chunks_of("chat_stream_token_ids")]
    # role, "wo", {} [161], "\ufffdwo", {} [161], "\ufffdwo", finish {} [161]
    assert kinds == [False, False, True, False, True, False, False]
    assert sum(map(only_hidden_ids, chunks_of("chat_stream_tool_named"))) == 35
    # Continuous usage on such a chunk is repeated by the next one: vLLM skips the chunk too.
    continuous = [only_hidden_ids(c) for c in chunks_of("chat_stream_token_ids_usage_continuous")]
    assert continuous == [False, False, True, False, False, False]
    for name in ("chat_stream_plain", "chat_stream_include_usage", "chat_stream_tool_required"):
        assert not any(map(only_hidden_ids, chunks_of(name)))


def test_a_chunk_with_logprobs_or_more_is_not_an_ids_only_chunk() -> None:
    hidden = chunks_of("chat_stream_token_ids")[2]
    assert only_hidden_ids(hidden)
    # vLLM sends an empty delta with logprobs whether or not IDs were asked for.
    for change in (
        lambda c: c["choices"][0].update(logprobs={"content": []}),
        lambda c: c["choices"][0].update(finish_reason="stop"),
        lambda c: c["choices"][0].update(delta={"content": ""}),
        lambda c: c.update(prompt_text="x"),
        lambda c: c.update(choices=[]),
    ):
        chunk = copy.deepcopy(hidden)
        change(chunk)
        assert not only_hidden_ids(chunk)


class Replay(httpx.AsyncBaseTransport):
    """A stand-in for vLLM 0.32 that answers the completion routes with a capture.

    It joins like the real one (``/health``, ``/metrics``, ``/v1/models``, and the token-ID
    probe, answered with a captured stream that carries IDs); ``answer`` names the capture for
    every other completion request, whose body is kept in ``requests``.
    """

    def __init__(self, answer: Callable[[dict[str, Any]], str]) -> None:
        self.answer = answer
        self.requests: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/metrics":  # no queue gauges: the health poller stops asking
            return httpx.Response(200, text="")
        if path == "/v1/models":
            name = "models"
        else:
            body = orjson.loads(await request.aread())
            if body.get("prompt") == "Narwhal token probe":
                name = "completions_stream_echo"
            else:
                self.requests.append(body)
                name = self.answer(body)
        answer = capture(name)
        headers = [("content-type", answer.header("content-type") or "application/json")]
        return httpx.Response(answer.status, headers=headers, stream=httpx.ByteStream(answer.body))


@pytest.fixture
async def replay(nursery: trio.Nursery) -> AsyncIterator[Callable[..., Any]]:
    """Start a router in front of one :class:`Replay` engine (model ``tiny``)."""
    clients: list[httpx.AsyncClient] = []

    async def start(answer: Callable[[dict[str, Any]], str]) -> tuple[httpx.AsyncClient, Replay]:
        engine = Replay(answer)
        settings = Config(
            engines=(engine_config("vllm"),),
            serving=ServingConfig(model="tiny"),
            upstream=UpstreamConfig(read_timeout_s=60),
            monitoring=MonitoringConfig(profiling=False),  # captured answers: no timing to fit
        )
        app = create_app(settings, transports={"vllm": engine})
        await nursery.start(partial(run_lifespan, app))
        client = httpx.AsyncClient(
            transport=ASGIStreamTransport(app, nursery), base_url="http://narwhal.test"
        )
        clients.append(client)
        with trio.fail_after(60):
            await get_router(app).wait_ready()
        return client, engine

    yield start
    for client in clients:
        await client.aclose()


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "stream": True}


async def test_a_client_without_ids_never_sees_the_chunks_vllm_sent_for_them(
    replay: Callable[..., Any], autojump_clock: trio.testing.MockClock
) -> None:
    client, engine = await replay(lambda body: "chat_stream_token_ids")
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    got = frames(response.text)
    assert got[-1] == "[DONE]"
    got = got[:-1]
    # The role chunk, three text chunks and the finish: the two ID-only chunks are gone.
    deltas = [chunk["choices"][0]["delta"] for chunk in got]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"content": "wo"},
        {"content": "\ufffdwo"},
        {"content": "\ufffdwo"},
        {},
    ]
    assert got[-1]["choices"][0]["finish_reason"] == "length"
    # Each one as vLLM sends it without return_token_ids (chat_stream_plain).
    plain = chunks_of("chat_stream_plain")
    for ours, theirs in ((got[0], plain[0]), (got[1], plain[1]), (got[-1], plain[-1])):
        assert without_identity(ours) == without_identity(theirs)
    assert engine.requests[0]["return_token_ids"] is True


async def test_a_client_that_asked_for_ids_gets_every_chunk_with_them(
    replay: Callable[..., Any], autojump_clock: trio.testing.MockClock
) -> None:
    client, _ = await replay(lambda body: "chat_stream_token_ids")
    response = await client.post("/v1/chat/completions", json={**CHAT, "return_token_ids": True})
    got = frames(response.text)[:-1]
    assert [without_identity(c) for c in got] == [
        without_identity(c) for c in chunks_of("chat_stream_token_ids")
    ]


async def test_a_tool_call_stream_loses_its_thirty_five_id_only_chunks(
    replay: Callable[..., Any], autojump_clock: trio.testing.MockClock
) -> None:
    client, _ = await replay(lambda body: "chat_stream_tool_named")
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = await client.post("/v1/chat/completions", json={**CHAT, "tool_choice": named})
    got = frames(response.text)[:-1]
    assert len(got) == 39 - 35
    # The shape vLLM streams without IDs (chat_stream_tool_required, another tool_choice).
    required = chunks_of("chat_stream_tool_required")
    assert [list(c["choices"][0]["delta"]) for c in got] == [
        list(c["choices"][0]["delta"]) for c in required
    ]
    assert all(c["choices"][0]["token_ids"] is None for c in got[1:])
    # Non-streaming, the same stream assembles into vLLM's own answer.
    whole = await client.post(
        "/v1/chat/completions", json={**CHAT, "stream": False, "tool_choice": named}
    )
    assert without_identity(whole.json()) == without_identity(
        capture("chat_nonstream_tool_named").json()
    )


# -- the non-streaming upstream path ------------------------------------------------------------


def received(fleet: Any) -> list[dict[str, Any]]:
    """The completion request bodies the engines received (probes left out)."""
    return [
        body
        for sim in fleet.sims.values()
        for body in sim.requests
        if body.get("prompt") != "Narwhal token probe" and body.get("user") != PROBE_USER
    ]


async def test_prompt_logprobs_go_upstream_non_streaming_and_the_answer_comes_back_as_is(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    sent = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello there, how are you today?"}],
        "prompt_logprobs": 1,
        "max_tokens": 7,
        "narwhal_sim": {"output_tokens": 5, "prompt_tokens": 9},
    }
    response = await fleet.client.post("/v1/chat/completions", json=sent)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    [upstream] = received(fleet)
    assert upstream == sent  # as the client sent it: no stream, no forced fields
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["usage"]["prompt_tokens"] == 9 and body["usage"]["completion_tokens"] == 5
    fleet.assert_quiescent()
    assert fleet.counters()["completed"] == 1
    # Measured from the answer's usage: the prompt's size and the output length are learned.
    assert fleet.router.sizer.statistics().observations == 1
    assert fleet.router.lengths.expected_total("chat", 7) == 5
    engines = fleet.router.statistics().engines
    assert sum(engine.completed for engine in engines) == 1


async def test_an_echo_goes_as_sent_streamed_or_not(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    streamed = await fleet.completion(echo=True, stream=True, max_tokens=3)
    assert streamed.status_code == 200 and frames(streamed.text)[-1] == "[DONE]"
    whole = await fleet.completion(echo=True, max_tokens=3)
    assert whole.status_code == 200 and whole.json()["object"] == "text_completion"
    chat = await fleet.chat(echo=True, max_tokens=3)
    assert chat.status_code == 200
    for body in received(fleet):
        assert "return_token_ids" not in body and "stream_interval" not in body
        assert "stream_options" not in body
    assert [body.get("stream") for body in received(fleet)] == [True, None, None]
    fleet.assert_quiescent()
    assert fleet.counters()["completed"] == 3


async def test_a_failed_whole_answer_is_retried_once_on_another_engine(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    fleet.set_directives("sim-a", {"fault": "http_500"})
    for _ in range(2):  # whichever engine is tried first
        response = await fleet.chat(prompt_logprobs=1)
        assert response.status_code == 200
    assert fleet.completions_received() in (3, 4)
    fleet.assert_quiescent()
    assert fleet.counters()["completed"] == 2


async def test_an_engines_refusal_of_a_whole_request_is_the_clients_error_and_not_retried(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    for name in fleet.sims:
        fleet.set_directives(name, {"fault": "http_400"})
    response = await fleet.chat(prompt_logprobs=1)
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert fleet.completions_received() == 1
    fleet.assert_quiescent()
    assert fleet.counters()["invalid_requests"] == 1


def placed_slot(fleet: Any) -> Slot:
    """The one slot placed on the fleet's engines."""
    [slot] = [slot for engine in fleet.router.pool.engines for slot in engine.slots]
    return slot


async def test_a_whole_request_decodes_from_its_predicted_first_token_and_meets_its_deadline(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    """No first token can be seen: the prefill slot is given up at the predicted one."""
    fleet = await start_fleet([engine_config("sim-a")])
    slow = {"prompt_logprobs": 1, "narwhal_sim": {"ttft_s": 2.0, "itl_s": 1.0, "output_tokens": 9}}
    start = trio.current_time()
    outcome: list[httpx.Response] = []

    async def late() -> None:
        outcome.append(
            await fleet.client.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **slow},
                headers={"x-narwhal-deadline-ms": "5000"},
            )
        )

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(late)
            await until(lambda: fleet.router.pool.engines[0].prefill == 1)
            slot = placed_slot(fleet)
            learned = slot.engine.forecast.scale, slot.engine.forecast.latency_s
            await trio.sleep_until(slot.predicted_first_token_at)
            await trio.testing.wait_all_tasks_blocked()
            [engine] = fleet.router.statistics().engines
            assert (engine.prefill, engine.decode) == (0, 1)
            assert slot.phase == "decode"
            # Nothing learned from a first token nobody saw.
            assert (slot.engine.forecast.scale, slot.engine.forecast.latency_s) == learned
    assert trio.current_time() - start == 5
    [response] = outcome
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "request_deadline_expired"
    assert fleet.sims["sim-a"].statistics().streams_closed_early == 1
    fleet.assert_quiescent()
    assert fleet.counters()["expired"] == 1


async def test_a_client_gone_during_a_whole_call_cancels_it_at_the_engine(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet([engine_config("sim-a")])
    slow = {"narwhal_sim": {"ttft_s": 10.0, "output_tokens": 1}}
    with trio.fail_after(60):
        with trio.move_on_after(1):
            await fleet.chat(prompt_logprobs=1, **slow)
        await until(lambda: fleet.router.in_flight() == 0)
    assert fleet.sims["sim-a"].statistics().streams_closed_early == 1
    fleet.assert_quiescent()
    assert fleet.counters()["cancelled"] == 1


async def test_whole_requests_share_the_prefill_slots_with_streams(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(
        [engine_config("sim-a")], admission=AdmissionConfig(mode="open", prefill_concurrency=1)
    )
    slow = {"narwhal_sim": {"ttft_s": 1.0, "itl_s": 1.0, "output_tokens": 2}}
    start = trio.current_time()
    done: dict[str, float] = {}

    async def one(name: str, **body: Any) -> None:
        response = await fleet.chat(**body, **slow)
        assert response.status_code == 200
        done[name] = trio.current_time() - start

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(one, "whole", prompt_logprobs=1))
            await until(lambda: fleet.router.statistics().engines[0].prefill == 1)
            predicted = placed_slot(fleet).predicted_first_token_at - start
            nursery.start_soon(one, "stream")
    # The stream takes the prefill slot at the whole request's predicted first token.
    assert done["whole"] == pytest.approx(2.0, abs=1e-9)
    assert done["stream"] == pytest.approx(predicted + 2.0, abs=1e-9)
    assert predicted < 1.0  # the prior's prediction, not the simulated engine's truth
    fleet.assert_quiescent()


async def test_a_non_streaming_tool_request_goes_as_sent(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    """vLLM answers a cut tool call whole as text, streamed as deltas: only its own whole
    answer is the answer."""
    fleet = await start_fleet()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    for choice in ("required", "auto", None):
        extra = {} if choice is None else {"tool_choice": choice}
        response = await fleet.chat(tools=tools, max_tokens=5, **extra)
        assert response.status_code == 200
    assert (await fleet.chat(tools=tools, tool_choice="none", max_tokens=5)).status_code == 200
    assert (await fleet.chat(tools=tools, max_tokens=5, stream=True)).status_code == 200
    # By tool choice (the engines' records are per engine, in whatever order placement took):
    sent = sorted(
        (str(body.get("tool_choice")), body.get("stream") is True) for body in received(fleet)
    )
    assert sent == [
        ("None", False),  # no tool_choice: tools go as sent, whole
        ("None", True),  # ... unless the client streams
        ("auto", False),
        ("none", True),  # no tools in play: streamed upstream as usual
        ("required", False),
    ]
    fleet.assert_quiescent()


async def test_vllms_non_streaming_answer_is_relayed_byte_for_byte(
    replay: Callable[..., Any], autojump_clock: trio.testing.MockClock
) -> None:
    client, engine = await replay(lambda body: "completions_nonstream_prompt_logprobs")
    sent = {"model": "tiny", "prompt": "Hello", "prompt_logprobs": 1, "max_tokens": 3}
    response = await client.post("/v1/completions", json=sent)
    assert response.status_code == 200
    assert response.content == capture("completions_nonstream_prompt_logprobs").body
    assert engine.requests == [sent]


async def test_a_whole_answer_that_is_not_json_is_a_502_that_says_not_to_retry(
    replay: Callable[..., Any], autojump_clock: trio.testing.MockClock
) -> None:
    client, engine = await replay(lambda body: "health")  # a 200 with an empty body
    response = await client.post(
        "/v1/chat/completions", json={**CHAT, "stream": False, "echo": True}
    )
    assert response.status_code == 502
    assert response.headers["x-should-retry"] == "false"
    assert response.json()["error"]["code"] == "malformed_engine_response"
    assert len(engine.requests) == 1  # the only engine: no other to retry on


async def test_a_whole_call_waiting_on_an_engine_whose_circuit_opens_is_retried_at_once(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    hole = faulty(fleet, "sim-a", read_timeout_s=600)
    await trio.sleep_until(10.5)
    hole.mode = "black_hole"
    with trio.fail_after(30):
        response = await fleet.chat(prompt_logprobs=1, narwhal_sim={"output_tokens": 2})
    assert response.status_code == 200
    # The circuit opened at 14.0 (polls at 11, 12, 13): the call was cut then and sent to
    # sim-b, instead of waiting out the 600 s read timeout.
    assert trio.current_time() == pytest.approx(14.0, abs=0.1)
    assert [body.get("stream") for body in received(fleet)] == [None]  # sim-b's; sim-a's hung
    fleet.assert_quiescent()
    assert fleet.counters()["completed"] == 1
