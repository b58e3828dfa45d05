"""``narwhal bench probes``: how fast ``/health`` and ``/ready`` answer while the router is busy.

One run starts a zero-delay simulated engine (``narwhal sim --profile zero``) and ``narwhal
serve`` in front of it with ``serving.probe_bind`` set, each as a subprocess on a free loopback
port. A probe sampler asks, every :attr:`ProbeSettings.interval_s`, the main port's and the
probe port's ``/health`` and ``/ready`` in turn, each on a new connection (as a kubelet does),
first with the router idle, then while a closed loop of streaming chat completions
(:mod:`narwhal.bench.load`) saturates it. The sampler is a process of its own, so that the load
generator's share of the interpreter does not count as the probes' latency. It prints each
probe's p50, p99 and maximum latency per phase, how many went unanswered within
:attr:`ProbeSettings.timeout_s`, what the load got (completed, refused by reason) and the
router's own worst loop lag (``narwhal_loop_lag_max_seconds``). The verdict: every probe-port
answer under load within :attr:`ProbeSettings.target_s` (100 ms). All processes share this
machine's CPU cores.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import multiprocessing
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from narwhal.bench import load
from narwhal.bench.procstat import environment
from narwhal.bench.services import (
    Service,
    ServiceError,
    free_port,
    lists_model,
    start_service,
    status_ok,
)
from narwhal.config import AdmissionConfig, Config, EngineConfig, ServingConfig, config_to_toml

__all__ = ["PROBES", "ProbeReport", "ProbeSettings", "run_probes"]

Echo = Callable[[str], None]

PROBES = ("main /health", "main /ready", "probe /health", "probe /ready")
"""The four probes, in the order each sampling round asks them."""


@attrs.frozen
class ProbeSettings:
    """What shapes a run.

    Attributes:
        model: the model name the engine serves and the requests ask for.
        concurrency: streaming requests the load keeps in flight.
        output_tokens: tokens per response.
        idle_s: how long probes are sampled before the load starts.
        load_s: how long they are sampled under load (after ``warmup_s`` of it).
        warmup_s: load before the sampling under load begins.
        interval_s: the pause between two sampling rounds.
        timeout_s: a probe unanswered this long counts as a timeout (a kubelet's default
            ``timeoutSeconds`` is 1).
        target_s: the bar for the probe port under load.
        startup_timeout_s: how long each process may take to become ready.
        log_dir: where the processes' logs and the configuration go (a temporary folder when
            ``None``).
    """

    model: str = "llama-3.1-8b-instruct"
    concurrency: int = 256
    output_tokens: int = 64
    idle_s: float = 3.0
    load_s: float = 20.0
    warmup_s: float = 2.0
    interval_s: float = 0.05
    timeout_s: float = 5.0
    target_s: float = 0.1
    startup_timeout_s: float = 60.0
    log_dir: Path | None = None

    def as_json(self) -> dict[str, Any]:
        """Plain values for the JSON report."""
        data = attrs.asdict(self)
        data["log_dir"] = None if self.log_dir is None else str(self.log_dir)
        return data


@attrs.frozen
class ProbeSummary:
    """One probe's latencies in one phase."""

    probe: str
    phase: str
    samples: int
    timeouts: int
    statuses: dict[str, int]
    p50_s: float
    p99_s: float
    max_s: float

    @classmethod
    def of(
        cls, probe: str, phase: str, latencies: list[float], statuses: list[str], timeouts: int
    ) -> ProbeSummary:
        """Summarise ``latencies`` (a timeout counts as the timeout)."""
        return cls(
            probe=probe,
            phase=phase,
            samples=len(latencies),
            timeouts=timeouts,
            statuses=dict(sorted(Counter(statuses).items())),
            p50_s=load.percentile(latencies, 50) if latencies else float("nan"),
            p99_s=load.percentile(latencies, 99) if latencies else float("nan"),
            max_s=max(latencies, default=float("nan")),
        )


@attrs.frozen
class ProbeReport:
    """A run's figures."""

    settings: dict[str, Any]
    environment: dict[str, Any]
    summaries: tuple[ProbeSummary, ...]
    load: dict[str, Any]
    worst_loop_lag_s: float | None

    def summary(self, probe: str, phase: str) -> ProbeSummary:
        """The summary of ``probe`` in ``phase`` (``idle`` or ``load``)."""
        return next(s for s in self.summaries if s.probe == probe and s.phase == phase)

    @property
    def passed(self) -> bool:
        """Every probe-port answer under load within the target."""
        target = self.settings["target_s"]
        probes = [self.summary(p, "load") for p in PROBES if p.startswith("probe")]
        return all(s.samples > 0 and s.timeouts == 0 and s.max_s <= target for s in probes)

    def as_json(self) -> dict[str, Any]:
        """Plain values for ``--output``."""
        return {
            "settings": self.settings,
            "environment": self.environment,
            "summaries": [attrs.asdict(s) for s in self.summaries],
            "load": self.load,
            "worst_loop_lag_s": self.worst_loop_lag_s,
            "passed": self.passed,
        }

    def render(self) -> str:
        """The text report."""
        lines = [
            f"narwhal bench probes: c={self.settings['concurrency']} streaming chat "
            f"completions ({self.settings['output_tokens']} tokens) against a zero-delay engine",
            "",
            f"{'probe':<15}{'phase':<7}{'n':>6}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
            f"{'timeouts':>10}  statuses",
        ]
        for s in self.summaries:
            statuses = ", ".join(f"{k}: {v}" for k, v in s.statuses.items())
            lines.append(
                f"{s.probe:<15}{s.phase:<7}{s.samples:>6}{s.p50_s * 1000:>9.1f}"
                f"{s.p99_s * 1000:>9.1f}{s.max_s * 1000:>9.1f}{s.timeouts:>10}  {statuses}"
            )
        got = self.load
        outcomes = ", ".join(f"{k}: {v}" for k, v in got["outcomes"].items())
        lines += [
            "",
            f"load: {got['requests']} requests in {got['wall_s']:.1f} s "
            f"({got['requests'] / max(got['wall_s'], 1e-9):.0f}/s); {outcomes}",
        ]
        if self.worst_loop_lag_s is not None:
            lines.append(f"router's worst event-loop lag: {self.worst_loop_lag_s * 1000:.0f} ms")
        target_ms = self.settings["target_s"] * 1000
        verdict = "PASS" if self.passed else "FAIL"
        lines.append(f"{verdict}: every probe-port answer under load within {target_ms:.0f} ms")
        return "\n".join(lines)


def run_probes(settings: ProbeSettings, *, echo: Echo = print) -> ProbeReport:
    """Start the processes, sample idle and under load, stop them, and return the report.

    Raises:
        narwhal.bench.services.ServiceError: a process could not start or become ready.
    """
    with contextlib.ExitStack() as stack:
        if settings.log_dir is not None:
            log_dir = settings.log_dir
            log_dir.mkdir(parents=True, exist_ok=True)
        else:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="nwprobes-")))
        router, probe_url = _start(settings, log_dir, stack, echo)
        urls = {
            "main /health": f"{router.url}/health",
            "main /ready": f"{router.url}/ready",
            "probe /health": f"{probe_url}/health",
            "probe /ready": f"{probe_url}/ready",
        }
        summaries, got = trio.run(_measure, settings, router.url, urls, echo)
        lag = _worst_lag(router.url)
    return ProbeReport(
        settings=settings.as_json(),
        environment=environment(("narwhal", "httpx", "trio", "hypercorn")),
        summaries=tuple(summaries),
        load=got,
        worst_loop_lag_s=lag,
    )


def _start(
    settings: ProbeSettings, log_dir: Path, stack: contextlib.ExitStack, echo: Echo
) -> tuple[Service, str]:
    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "narwhal", "sim", "--bind", f"127.0.0.1:{port}"]
    argv += ["--model", settings.model, "--dialect", "vllm", "--profile", "zero", "--seed", "1"]
    engine = start_service("engine", argv, url=engine_url, log_dir=log_dir)
    stack.callback(engine.stop)
    engine.wait_ready(
        [("/health", status_ok), ("/v1/models", lists_model(settings.model))],
        deadline_s=settings.startup_timeout_s,
    )
    probe_port, port = free_port(), free_port()
    config = Config(
        serving=ServingConfig(model=settings.model, probe_bind=f"127.0.0.1:{probe_port}"),
        # A zero-delay engine has no capacity to protect, and every request is relayed
        # (open mode, limits lifted): the load saturates the router itself.
        admission=AdmissionConfig(mode="open", prefill_concurrency=4096, decode_concurrency=4096),
        engines=(EngineConfig(name="sim", url=engine_url, dialect="vllm"),),
    )
    path = log_dir / "narwhal.toml"
    path.write_text(config_to_toml(config))
    argv = [sys.executable, "-m", "narwhal", "serve", "--config", str(path)]
    argv += ["--bind", f"127.0.0.1:{port}"]
    router = start_service("narwhal", argv, url=f"http://127.0.0.1:{port}", log_dir=log_dir)
    stack.callback(router.stop)
    router.wait_ready([("/ready", status_ok)], deadline_s=settings.startup_timeout_s)
    _wait_probe_ready(f"http://127.0.0.1:{probe_port}/ready", settings.startup_timeout_s)
    echo(f"narwhal: ready on {router.url}, probes on 127.0.0.1:{probe_port}")
    return router, f"http://127.0.0.1:{probe_port}"


async def _measure(
    settings: ProbeSettings, router_url: str, urls: dict[str, str], echo: Echo
) -> tuple[list[ProbeSummary], dict[str, Any]]:
    # The sampler runs in a process of its own: in this one it would wait for the load
    # generator's share of the interpreter, which is no part of what the probes cost.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as sampler:
        summaries = await _in_process(sampler, settings, urls, settings.idle_s, "idle")
        echo("idle: sampled")
        records: list[load.RequestRecord] = []
        url = router_url + "/v1/chat/completions"
        numbers = itertools.count()
        async with load.ClientPool(timeout_s=60.0) as pool, trio.open_nursery() as nursery:

            async def worker() -> None:
                for index in numbers:
                    body = load.chat_body(
                        settings.model, output_tokens=settings.output_tokens, index=index
                    )
                    records.append(await pool.send(url, body, index))

            started = time.perf_counter()
            for _ in range(settings.concurrency):
                nursery.start_soon(worker)
            await trio.sleep(settings.warmup_s)
            summaries += await _in_process(sampler, settings, urls, settings.load_s, "load")
            wall_s = time.perf_counter() - started
            nursery.cancel_scope.cancel()
    echo("load: sampled")
    outcomes = Counter("completed" if r.ok else str(r.error) for r in records)
    got = {"requests": len(records), "wall_s": wall_s, "outcomes": dict(outcomes.most_common())}
    return summaries, got


async def _in_process(
    sampler: ProcessPoolExecutor,
    settings: ProbeSettings,
    urls: dict[str, str],
    duration_s: float,
    phase: str,
) -> list[ProbeSummary]:
    future = sampler.submit(_sample, settings, urls, duration_s, phase)
    return await trio.to_thread.run_sync(future.result)


def _sample(
    settings: ProbeSettings, urls: dict[str, str], duration_s: float, phase: str
) -> list[ProbeSummary]:
    """Ask every probe in turn until ``duration_s`` is over (in a thread of its own)."""
    latencies: dict[str, list[float]] = {name: [] for name in urls}
    statuses: dict[str, list[str]] = {name: [] for name in urls}
    timeouts = dict.fromkeys(urls, 0)
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        for name, url in urls.items():
            elapsed, status = _ask(url, settings.timeout_s)
            latencies[name].append(elapsed)
            statuses[name].append(status)
            if status == "timeout":
                timeouts[name] += 1
        time.sleep(settings.interval_s)  # the sampler's own pace, in its own thread
    return [
        ProbeSummary.of(name, phase, latencies[name], statuses[name], timeouts[name])
        for name in urls
    ]


def _ask(url: str, timeout_s: float) -> tuple[float, str]:
    """One ``GET`` on a new connection: seconds to the whole answer, and its status."""
    rest = url.removeprefix("http://")
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    began = time.perf_counter()
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        connection.request("GET", "/" + path, headers={"connection": "close"})
        response = connection.getresponse()
        response.read()
        status = str(response.status)
    except TimeoutError:
        return time.perf_counter() - began, "timeout"
    except OSError as exc:
        return time.perf_counter() - began, type(exc).__name__
    finally:
        connection.close()
    return time.perf_counter() - began, status


def _wait_probe_ready(url: str, deadline_s: float) -> None:
    """Until the probe port's ``/ready`` is 200 (its snapshot trails the main port's)."""
    deadline = time.monotonic() + deadline_s
    while _ask(url, 2.0)[1] != "200":
        if time.monotonic() > deadline:
            raise ServiceError(f"the probe listener's {url} never answered 200")
        time.sleep(0.02)  # polling, with the deadline above


def _worst_lag(url: str) -> float | None:
    try:
        text = httpx.get(f"{url}/metrics", timeout=5.0, trust_env=False).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("narwhal_loop_lag_max_seconds "):
            return float(line.split()[1])
    return None
