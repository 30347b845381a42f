"""Step costs profiled at start-up (app/runners/profile.py) and fed to the cost model
(app/policy/step_profile.py): every (batch bucket, width) of the target and (batch, depth) of the
draft is measured on scratch sequences that leave nothing behind; seeded, the cost model prices
those passes as profiled before any traffic; live measurements then take over."""

from __future__ import annotations

import pytest

from app.policy import StepCosts
from app.policy.step_profile import DraftTime, PassTime, StepProfile, seed_costs
from app.proposers import DraftModelProposer
from app.runners.profile import profile_draft, profile_target


def test_the_target_is_profiled_at_every_bucket_and_width_and_left_empty(target_runner):
    passes = profile_target(target_runner, widths=[1, 3], repeats=2, max_batch=4)
    assert [(p.batch, p.width) for p in passes] == [(1, 1), (1, 3), (2, 1), (2, 3), (4, 1), (4, 3)]
    assert all(p.seconds > 0 for p in passes)
    assert target_runner.num_sequences == 0 and target_runner.cached_tokens() == 0
    target_runner.add("busy")
    try:
        with pytest.raises(RuntimeError):  # scratch rows on top of a live one would profile other buckets
            profile_target(target_runner, widths=[1])
    finally:
        target_runner.remove("busy")


def test_the_draft_is_profiled_per_batch_and_depth_and_releases_its_sequences(draft_runner):
    proposer = DraftModelProposer(runner=draft_runner)
    steps = profile_draft(proposer, draft_runner.vocab_size, batches=[1, 2], depths=[1, 4], repeats=2)
    assert [(d.batch, d.depth) for d in steps] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert all(d.seconds > 0 for d in steps)
    assert proposer.num_cached_sequences() == 0 and draft_runner.num_sequences == 0


def test_a_seeded_cost_model_prices_the_profiled_passes_and_live_steps_keep_them_current():
    profile = StepProfile(
        target=[PassTime(1, 1, 0.010), PassTime(1, 5, 0.011), PassTime(8, 1, 0.012), PassTime(8, 5, 0.030),
                PassTime(32, 1, 0.020), PassTime(32, 5, 0.090)],
        draft=[DraftTime(1, 4, 0.008), DraftTime(8, 4, 0.012), DraftTime(32, 4, 0.040)],
        exchange_s=0.0004)
    costs = StepCosts()
    seed_costs(costs, profile)
    # the prior (20 ms at one token, flat to 64 tokens) is gone where the profile measured
    assert costs.t_decode(1) == pytest.approx(0.010)
    assert costs.t_verify(8, 4) == pytest.approx(0.030)  # 40 tokens
    assert costs.t_verify(32, 4) == pytest.approx(0.090, rel=0.02)  # 160 tokens (a ~3 % bucket): as measured
    assert costs.t_draft(8) == pytest.approx(0.003)  # 12 ms for 4 steps
    assert costs.t_exchange == pytest.approx(0.0004)
    assert "8x5" in profile.summary()["target_ms"]
    # the engine measures the 8 x 5 pass slower now (the host changed): the curve follows
    for _ in range(40):
        costs.observe_target(40, 0.045)
    assert costs.t_verify(8, 4) == pytest.approx(0.045, rel=0.03)


def test_a_target_replica_seeds_the_draft_replicas_profile_once_it_has_its_channel():
    """The draft replica's start-up profile travels with its channel() answer; the target replica's
    cost model takes it at the first drafting step after, once per profile."""
    from types import SimpleNamespace

    from app.engine.draft_ahead import DraftCallTimes
    from app.proposers.base import FirstPass
    from deployments.draft_server import ChannelInfo
    from deployments.step_window import StepWindow
    from deployments.target_server import RemoteDraftTransport, TargetServer

    profile = (DraftTime(1, 4, 0.008), DraftTime(8, 4, 0.012))
    info = ChannelInfo("127.0.0.1", 1, "token", profile)
    handle = SimpleNamespace(channel=SimpleNamespace(remote=lambda _req: SimpleNamespace(result=lambda timeout_s: info)))
    transport = RemoteDraftTransport(handle, "target-1")
    assert transport._resolve() == ("127.0.0.1", 1, "token")
    assert transport.step_profile is not None and transport.step_profile.draft == list(profile)

    call = DraftCallTimes(8, 4, 0.0043, 0.004, 0.0003, FirstPass())  # batch 8, depth 4: the replica's 4 ms and the hop
    engine = SimpleNamespace(last_times=SimpleNamespace(target=0.01, draft_calls=(call,)))
    server = SimpleNamespace(policy=SimpleNamespace(costs=StepCosts()), _transport=transport,
                             _draft_profile_seeded=None, window=StepWindow(),
                             pass_parts={"passes": 0, "pass_s": 0.0, "draft_s": 0.0, "exchange_s": 0.0})
    observe = TargetServer.func_or_class._observe_draft
    observe(server, engine, 0.0043)  # a live step at batch 8: 4 draft steps in 4 ms (the profile said 3 ms each)
    assert server._draft_profile_seeded is transport.step_profile
    assert server.policy.costs.t_draft(1) == pytest.approx(0.002)  # batch 1 only from the profile: 8 ms / 4
    seeded_at_8 = server.policy.costs.t_draft(8)
    assert 0.001 < seeded_at_8 < 0.003  # the profile's 3 ms and the live 1 ms, weighed
    observe(server, engine, 0.0043)  # the same profile is not fed again: only the live step moves it
    assert server.policy.costs.t_draft(1) == pytest.approx(0.002)
    assert server.policy.costs.t_draft(8) < seeded_at_8
