"""SSE decoding: every framing a relay may meet, fed in arbitrary pieces."""

import pytest

from narwhal.protocol.sse import SSEDecoder, SSEEvent, encode_data, encode_done

STREAM = b'data: {"a":1}\n\n: keep-alive\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'


def decode_in_pieces(data: bytes, size: int) -> list[SSEEvent]:
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    for start in range(0, len(data), size):
        events.extend(decoder.feed(data[start : start + size]))
    last = decoder.flush()  # a final lone CR may still be half of a CRLF until the end
    return [*events, last] if last is not None else events


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_events_survive_any_split(size: int) -> None:
    assert decode_in_pieces(STREAM, size) == [
        SSEEvent(b'{"a":1}'),
        SSEEvent(b'{"b":2}'),
        SSEEvent(b"[DONE]"),
    ]


@pytest.mark.parametrize("newline", [b"\r\n", b"\r"])
@pytest.mark.parametrize("size", [1, 5, 1000])
def test_crlf_and_cr_framings(newline: bytes, size: int) -> None:
    data = STREAM.replace(b"\n", newline)
    assert [event.data for event in decode_in_pieces(data, size)] == [
        b'{"a":1}',
        b'{"b":2}',
        b"[DONE]",
    ]


def test_multiline_data_and_event_names() -> None:
    decoder = SSEDecoder()
    events = decoder.feed(b"event: sglext_ids\ndata: a\ndata:b\nid: 3\n\n")
    assert events == [SSEEvent(b"a\nb", "sglext_ids")]


def test_comment_only_blocks_produce_nothing() -> None:
    assert SSEDecoder().feed(b": ping\n\n:\n\n") == []


def test_flush_returns_an_unterminated_event() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"a":1}\n\ndata: {"trunc') == [SSEEvent(b'{"a":1}')]
    assert decoder.flush() == SSEEvent(b'{"trunc')
    assert decoder.flush() is None


def test_encoding() -> None:
    assert encode_data(b"{}") == b"data: {}\n\n"
    assert encode_done() == b"data: [DONE]\n\n"
