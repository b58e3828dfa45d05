"""Engines over HTTP: pooled clients, streams, and what Narwhal adds to a request."""

from narwhal.upstream.client import (
    ChunkEvent,
    DoneEvent,
    EngineClient,
    ErrorFrameEvent,
    UpstreamEvent,
    UpstreamStream,
)
from narwhal.upstream.dialects import plan_upstream

__all__ = [
    "ChunkEvent",
    "DoneEvent",
    "EngineClient",
    "ErrorFrameEvent",
    "UpstreamEvent",
    "UpstreamStream",
    "plan_upstream",
]
