"""The real application's metrics on Ray's Prometheus endpoint, under real traffic.

The app runs in a child process with its own Ray (bench/app_process.py): Ray's metrics export port
can only be set by the `ray.init` that starts Ray, and the session Ray of tests/serve/conftest.py
must not be disturbed. Traffic: concurrent speculating requests (speculation "on"), plus plain
("off") and policy-decided ("auto") ones. Then one scrape of 127.0.0.1:<metrics port>/metrics
must agree with what the responses' `usage.speculation` reported, token for token.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from typing import Any, Iterator

import httpx
import pytest

from app import metrics as m
from bench.app_process import AppProcess, Sample, local_args, scrape, total

pytestmark = [pytest.mark.serve, pytest.mark.slow]

MODEL = "specserve-embedded"
PROMPTS = (
    "def read_config(path):\n",
    "import os\nimport sys\n\n\nclass ",
    "    for i in range(len(items)):\n",
    "def __init__(self, name, value=None):\n        self.",
)
SCRAPE_DEADLINE_S = 60.0
LOAD_DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def app() -> Iterator[AppProcess]:
    # One target and one draft replica, so per-replica gauges are this test's load alone.
    with AppProcess(local_args()) as proc:
        yield proc


def _complete(client: httpx.Client, url: str, prompt: str, speculation: str, max_tokens: int,
              stream: bool = False) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "speculation": speculation, "ignore_eos": True, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    if not stream:
        r = client.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    usage = None
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                usage = json.loads(line[len("data: "):]).get("usage") or usage
    assert usage is not None, "stream ended without a usage chunk"
    return usage


class Load:
    """Clients sending speculating requests back to back until stopped; keeps every usage."""

    def __init__(self, url: str, clients: int, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.usages: list[dict[str, Any]] = []
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        with httpx.Client() as client:
            n = 0
            while not self.stop.is_set():
                try:
                    usage = _complete(client, self.url, PROMPTS[(i + n) % len(PROMPTS)], "on",
                                      self.max_tokens, stream=bool(n % 2))
                except BaseException as e:  # noqa: BLE001 — reported by the test
                    with self.lock:
                        self.errors.append(e)
                    return
                with self.lock:
                    self.usages.append(usage)
                n += 1

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=150)
        assert not any(t.is_alive() for t in self.threads), "load clients did not finish"


def _gauge(samples: list[Sample], metric: m.MetricDef) -> float:
    return total(samples, metric.exported, deployment="TargetServer")


def test_spec_decode_router_latency_and_load_metrics(app: AppProcess) -> None:
    url = app.url
    # ---- sustained speculating load; watch the per-replica gauges while it runs
    peak = {d.name: 0.0 for d in (m.RUNNING_SEQUENCES, m.KV_CACHED_TOKENS, m.KV_CACHED_SEQUENCES)}
    with Load(url, clients=4, max_tokens=160) as load:
        deadline = time.monotonic() + LOAD_DEADLINE_S
        while time.monotonic() < deadline and not load.errors:
            samples = scrape(app.metrics_port)
            for d in (m.RUNNING_SEQUENCES, m.KV_CACHED_TOKENS, m.KV_CACHED_SEQUENCES):
                peak[d.name] = max(peak[d.name], _gauge(samples, d))
            if peak[m.RUNNING_SEQUENCES.name] >= 2 and len(load.usages) >= 4:
                break
            time.sleep(1.0)
    assert not load.errors, load.errors
    assert peak[m.RUNNING_SEQUENCES.name] >= 2, f"running sequences never reached 2 under 4 clients: {peak}"
    assert 2 <= peak[m.KV_CACHED_SEQUENCES.name] <= 16  # configs/local.yaml: max_num_seqs 16
    # Each running sequence holds at least its prompt in the KV cache.
    assert peak[m.KV_CACHED_TOKENS.name] >= 2 * 5

    # ---- a few plain and policy-decided requests (router decision counters)
    usages = list(load.usages)
    with httpx.Client() as client:
        for mode in ("off", "off", "auto", "auto"):
            usages.append(_complete(client, url, PROMPTS[0], mode, 24))
        # errors by status: an unknown model (404) and a bad field (400)
        bad = {"model": "no-such-model", "prompt": "x", "max_tokens": 4}
        assert client.post(f"{url}/v1/completions", json=bad, timeout=30).status_code == 404
        bad = {"model": MODEL, "prompt": "x", "max_tokens": -1}
        assert client.post(f"{url}/v1/completions", json=bad, timeout=30).status_code == 400

    spec = [u["speculation"] for u in usages]
    want = {
        "drafted": sum(s["drafted_tokens"] for s in spec),
        "accepted": sum(s["accepted_tokens"] for s in spec),
        "drafts": sum(s["num_drafts"] for s in spec),
    }
    assert want["drafted"] > 0 and want["drafts"] > 0
    decisions = Counter(("speculate" if s["mode"] == "speculative" else "plain", s["reason"]) for s in spec)
    n = len(usages)

    # ---- the exported counters catch up with the responses exactly (Ray exports every few s)
    def current() -> tuple[dict[str, float], list[Sample]]:
        s = scrape(app.metrics_port)
        return ({"drafted": total(s, m.NUM_DRAFT_TOKENS.exported),
                 "accepted": total(s, m.NUM_ACCEPTED_TOKENS.exported),
                 "drafts": total(s, m.NUM_DRAFTS.exported)}, s)

    deadline = time.monotonic() + SCRAPE_DEADLINE_S
    got, samples = current()
    # every series the assertions below read must have caught up: Ray exports each metric on its own
    while (got != want or total(samples, m.TTFT.series("count")) < n
           or total(samples, m.ROUTER_DECISIONS.exported) < n
           or total(samples, m.TPOT.series("count")) < sum(u["completion_tokens"] > 1 for u in usages)
           or total(samples, m.GENERATION_TOKENS.exported) < sum(u["completion_tokens"] for u in usages)
           or total(samples, m.REQUEST_SUCCESS.exported) < n or total(samples, m.REQUEST_ERRORS.exported) < 2
           or total(samples, m.E2E_LATENCY.series("count")) < n
           or _gauge(samples, m.RUNNING_SEQUENCES) != 0) and time.monotonic() < deadline:
        time.sleep(1.0)
        got, samples = current()
    assert got == want, f"exported spec-decode counters {got} != responses' usage {want}"

    # vLLM's definitions hold on the exported series.
    rate = got["accepted"] / got["drafted"]
    assert 0 < rate <= 1, rate
    mean_len = 1 + got["accepted"] / got["drafts"]
    assert 1 < mean_len <= 1 + 8  # max_speculative_tokens 8
    per_pos = [total(samples, m.NUM_ACCEPTED_PER_POS.exported, position=str(i)) for i in range(m.MAX_POSITIONS)]
    assert sum(per_pos) == got["accepted"]
    assert per_pos[0] <= got["drafts"]
    # position i can only be accepted if i-1 was
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos

    # Router decisions: one per request, labelled as the responses say.
    for (decision, reason), count in decisions.items():
        assert total(samples, m.ROUTER_DECISIONS.exported, decision=decision, reason=reason) == count
    assert total(samples, m.ROUTER_DECISIONS.exported) == n
    assert decisions[("plain", "forced_off")] == 2
    assert decisions[("speculate", "forced_on")] == len(load.usages)

    # Latency histograms, recorded by the router: one TTFT per request, one TPOT per request with
    # more than one token; cumulative buckets, +Inf bucket == count.
    for hist, count in ((m.TTFT, n), (m.TPOT, sum(u["completion_tokens"] > 1 for u in usages))):
        assert total(samples, hist.series("count"), deployment="Router") == count
        buckets = sorted(((float(lab["le"]), v) for name, lab, v in samples
                          if name == hist.series("bucket") and lab.get("deployment") == "Router"))
        assert [le for le, _ in buckets] == [*hist.buckets, float("inf")]
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and counts[-1] == count
        assert total(samples, hist.series("sum")) > 0
    # Request-level series, recorded by the router, labelled with the served model.
    router = {"deployment": "Router", "model_name": MODEL}
    assert total(samples, m.PROMPT_TOKENS.exported, **router) == sum(u["prompt_tokens"] for u in usages)
    assert total(samples, m.GENERATION_TOKENS.exported, **router) == sum(u["completion_tokens"] for u in usages)
    assert total(samples, m.REQUEST_SUCCESS.exported, finished_reason="length", **router) == n  # ignore_eos
    assert total(samples, m.REQUEST_SUCCESS.exported) == n
    assert total(samples, m.E2E_LATENCY.series("count"), **router) == n
    itl = total(samples, m.ITL.series("count"), **router)
    assert 0 < itl <= sum(u["completion_tokens"] - 1 for u in usages)  # one per chunk after the first
    assert total(samples, m.REQUEST_ERRORS.exported, status="404", **router) == 1
    assert total(samples, m.REQUEST_ERRORS.exported, status="400", **router) == 1
    assert total(samples, m.FAILOVERS.exported) == 0  # not exported until one happens

    # Step times by kind: the target verifies and decodes, the draft server drafts.
    assert total(samples, m.STEP_TIME.series("count"), kind="verify", deployment="TargetServer") > 0
    assert total(samples, m.STEP_TIME.series("count"), kind="decode", deployment="TargetServer") > 0
    assert total(samples, m.STEP_TIME.series("count"), kind="draft", deployment="DraftServer") > 0

    # Load gauges are per replica and back to idle once the traffic is done.
    for d in (m.RUNNING_SEQUENCES, m.QUEUE_LENGTH, m.KV_CACHED_TOKENS, m.KV_CACHED_SEQUENCES):
        series = [(lab, v) for name, lab, v in samples if name == d.exported]
        assert series, f"{d.exported} not exported"
        assert {lab["deployment"] for lab, _ in series} == {"TargetServer"}
        assert all(lab["application"] == "specserve" and lab["replica"] for lab, _ in series)
        assert all(v == 0 for _, v in series), (d.exported, series)
    # Serve's own series the dashboard reads.
    healthy = {lab["deployment"]: v for name, lab, v in samples if name == m.SERVE_REPLICA_HEALTHY}
    assert healthy == {"Router": 1, "TargetServer": 1, "DraftServer": 1}
