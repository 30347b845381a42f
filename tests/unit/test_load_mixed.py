"""bench.load's mixed traffic on a random-weight pair (bench/load_mixed.py), without starting an app:
prompts land in the class the router's classifier gives them, both classes see the same lengths, the
app config is valid for the GPU and CPU pairs, the GPU plan fits its 10-minute slot, and the sweep's
round-by-round order with a deadline stops before a cell it could not finish."""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter
from pathlib import Path

import pytest

import bench.load
from app.config import AppConfig
from app.policy import classify_prompt
from bench.load import MIXED_PLAN, Cell, sweep
from bench.load_mixed import (CLASSES, LENGTHS, MAX_K, PROMPT_TOKENS, MixedWorkload, app_config, make_prompts,
                              plan_seconds, prompt_classes)


def test_prompts_are_in_the_class_the_router_gives_them() -> None:
    prompts = make_prompts(128256, per_class=6)
    prompt_classes(prompts)  # raises otherwise
    for cls in CLASSES:
        assert {classify_prompt(t) for t in prompts[cls]} == {cls}
        # word-level tokens, one per word (and "=" one): at least the 32 the references are keyed by
        assert all(len(t.split()) >= PROMPT_TOKENS for t in prompts[cls])
    with pytest.raises(AssertionError):
        prompt_classes({"code": prompts["prose"][:1]})


def test_each_class_sees_every_length_and_the_sequence_is_the_same_in_every_cell() -> None:
    workload = MixedWorkload(make_prompts(1024, per_class=4))
    for client in range(3):
        seq = [workload.request(client, n) for n in range(2 * len(LENGTHS))]
        assert seq == [workload.request(client, n) for n in range(2 * len(LENGTHS))]
        by_class = {cls: Counter(f["max_tokens"] for f, c in seq if c == cls) for cls in CLASSES}
        assert by_class["code"] == by_class["prose"] == Counter(LENGTHS)  # the same lengths, once each
        assert [c for _, c in seq[:4]] in (["code", "prose"] * 2, ["prose", "code"] * 2)  # classes alternate
    assert min(LENGTHS) == 16 and max(LENGTHS) == 512


@pytest.mark.parametrize("shape,device", [("tiny", "cpu"), ("8b", "cuda")])
def test_the_app_config_is_valid_and_holds_every_stream(tmp_path: Path, shape: str, device: str) -> None:
    config = AppConfig.model_validate(app_config(shape, device, 64, {"margin": 1.1}, tmp_path))
    assert config.engine.limits.max_num_seqs == 64 and config.target_deployment.max_ongoing_requests >= 64
    assert config.engine.speculation.max_speculative_tokens == MAX_K
    assert config.engine.target.random_weights and config.engine.draft.random_weights
    assert config.policy.margin == 1.1 and config.policy.mode_arbiter.enabled  # the shipped policy, overridden
    assert (config.engine.draft.quantization == "int8") == (device == "cuda")


def test_the_gpu_plan_fits_a_ten_minute_slot() -> None:
    levels = [int(x) for x in MIXED_PLAN["levels"].split(",")]
    assert levels == [1, 4, 16, 32, 64]
    plan = plan_seconds("8b", "cuda", levels, MIXED_PLAN["rounds"], MIXED_PLAN["warmup"], MIXED_PLAN["duration"], MAX_K)
    assert plan["total"] < 8.5 * 60 and MIXED_PLAN["time_limit"] <= 570


def test_rounds_run_over_every_level_in_turn_and_no_cell_starts_past_the_deadline(monkeypatch) -> None:
    ran: list[tuple[int, str, int]] = []

    async def fake_run_cell(url, policy, c, warmup, duration, workload, round_):
        ran.append((c, policy, round_))
        return Cell(policy=policy, concurrency=c, seconds=duration, tokens=10, goodput_tok_s=1.0, completed=1,
                    failed=0, latency_p50_s=None, latency_p99_s=None, acceptance_rate=None, round=round_)

    async def no_wait(_url: str) -> None:
        return None

    monkeypatch.setattr(bench.load, "run_cell", fake_run_cell)
    monkeypatch.setattr(bench.load, "wait_idle", no_wait)
    args = argparse.Namespace(rounds=2, warmup=0.0, duration=0.0, max_steal=None, steal_retries=0,
                              workload=MixedWorkload(make_prompts(1024, 2)), rounds_first=True, deadline=None)
    cells = asyncio.run(sweep("http://127.0.0.1:1", [1, 4], args, []))
    assert [(c, r) for c, _, r in ran] == [(1, 0)] * 3 + [(4, 0)] * 3 + [(1, 1)] * 3 + [(4, 1)] * 3
    assert len(cells) == 12 and {p for c, p, r in ran if c == 4 and r == 1} == {"on", "off", "auto"}
    ran.clear()
    args.deadline = 0.0  # long past: nothing starts
    assert asyncio.run(sweep("http://127.0.0.1:1", [1, 4], args, [])) == [] and ran == []
