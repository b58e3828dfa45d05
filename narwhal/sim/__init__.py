"""The engine simulator: vLLM, SGLang and OpenAI shapes with simulated timing and faults.

* :class:`SimEngine` plans answers (pure) and :class:`SimStream` plays them in Trio time;
  :mod:`narwhal.sim.engine` documents the request fields honoured and the test directives.
* :class:`SimTransport` serves an engine to an ``httpx.AsyncClient`` in-process (virtual time).
* :func:`create_sim_app` / :func:`serve_sim` serve it over HTTP (``narwhal sim``).
* :data:`PROFILES` say how long things take: :class:`StepTiming` runs the engine as a
  continuous-batching step loop (:class:`Batcher` holds its rules), :class:`LinearTiming` times
  each request alone.
"""

from narwhal.sim.batching import Batcher, BatcherStatistics
from narwhal.sim.engine import (
    Frame,
    SimConnectionDropped,
    SimEngine,
    SimEngineStatistics,
    SimPlan,
    SimStream,
)
from narwhal.sim.server import create_sim_app, serve_sim
from narwhal.sim.timing import PROFILES, LinearTiming, StepTiming, TimingModel, profile
from narwhal.sim.transport import SimTransport, SimTransportStatistics

__all__ = [
    "PROFILES",
    "Batcher",
    "BatcherStatistics",
    "Frame",
    "LinearTiming",
    "SimConnectionDropped",
    "SimEngine",
    "SimEngineStatistics",
    "SimPlan",
    "SimStream",
    "SimTransport",
    "SimTransportStatistics",
    "StepTiming",
    "TimingModel",
    "create_sim_app",
    "profile",
    "serve_sim",
]
