"""``narwhal demo``: the router and two simulated engines in one process.

The engines run in-process (the simulator as httpx transports), so the demo needs no other
command and no free ports besides the router's own. The URL and ready-to-paste examples are
printed only once ``/ready`` would answer 200, so a newcomer's first request succeeds.
"""

from __future__ import annotations

import httpx
import trio

from narwhal.cli import run_listening
from narwhal.config import AdminConfig, AdmissionConfig, Config, EngineConfig, ServingConfig
from narwhal.server import serve
from narwhal.sim.engine import SimEngine
from narwhal.sim.timing import profile
from narwhal.sim.transport import SimTransport

__all__ = ["demo_config", "demo_transports", "run_demo"]

MODEL = "llama-3.1-8b-instruct"


def demo_config(bind: str = "127.0.0.1:8000") -> Config:
    """The embedded defaults: two vLLM-dialect engines behind one router. The admin routes, the
    live view and the dashboard need no token from this machine (loopback callers only)."""
    return Config(
        serving=ServingConfig(model=MODEL, bind=bind),
        admission=AdmissionConfig(),
        admin=AdminConfig(allow_loopback_without_token=True),
        engines=(
            EngineConfig(name="sim-a", url="http://sim-a.invalid", dialect="vllm", wave="a"),
            EngineConfig(name="sim-b", url="http://sim-b.invalid", dialect="vllm", wave="b"),
        ),
    )


def demo_transports(
    config: Config, *, time_scale: float = 1.0
) -> dict[str, httpx.AsyncBaseTransport]:
    """One in-process simulated engine per configured engine."""
    return {
        engine.name: SimTransport(
            SimEngine(
                config.serving.model,
                dialect=engine.dialect,
                timing=profile(engine.profile, time_scale=time_scale, jitter=0.1, seed=seed),
                seed=seed,
                name=engine.name,
            )
        )
        for seed, engine in enumerate(config.engines)
    }


def examples(url: str, model: str) -> str:
    """The text printed once the demo is ready."""
    return f"""
Narwhal is ready at {url}  (two simulated engines; Ctrl-C to stop)

  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "stream": true,
         "messages": [{{"role": "user", "content": "Hello, Narwhal!"}}]}}'

  # Python: needs the openai package (pip install openai, or pip install -e '.[demo]')
  python -c '
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="unused")
reply = client.chat.completions.create(
    model="{model}", messages=[{{"role": "user", "content": "Hello, Narwhal!"}}])
print(reply.choices[0].message.content)'

  Status: curl {url}/ready    Metrics: curl {url}/metrics
  Live view: narwhal top --url {url}    Dashboard: {url}/dashboard
"""


READY_WITHIN_S = 30.0
"""How long ``narwhal demo`` waits for its router to be ready before it gives up."""


class DemoNotReady(RuntimeError):
    """The demo's router was not ready in time (one line from the command, exit status 2)."""


async def _ready(client: httpx.AsyncClient, url: str) -> bool:
    """Whether ``/ready`` answers 200 now (a router not listening yet, or no more, is not)."""
    try:
        return (await client.get(f"{url}/ready")).status_code == 200
    except httpx.HTTPError:
        return False


def run_demo(*, bind: str = "127.0.0.1:8000", time_scale: float = 1.0) -> int:
    """Serve the demo until Ctrl-C; returns the exit status."""
    config = demo_config(bind)
    transports = demo_transports(config, time_scale=time_scale)

    async def main() -> None:
        stopped = trio.Event()

        async def serving(*, task_status: trio.TaskStatus[list[str]]) -> None:
            try:
                await serve(
                    config, transports=transports, handle_signals=True, task_status=task_status
                )
            finally:
                stopped.set()

        async with trio.open_nursery() as nursery:
            url = (await nursery.start(serving))[0]
            async with httpx.AsyncClient() as client:
                with trio.move_on_after(READY_WITHIN_S) as waiting:
                    while not await _ready(client, url):
                        if stopped.is_set():
                            return  # Ctrl-C before it was ready: serve() has shut down
                        await trio.sleep(0.05)
            if waiting.cancelled_caught:
                raise DemoNotReady(f"the router was not ready within {READY_WITHIN_S:g} s")
            print(examples(url, config.serving.model), flush=True)

    return run_listening("demo", bind, main)
