"""bench/median_noise.py: the noise model read from a sweep's forced cells, and the pass rate of
two identical policies under it."""

from __future__ import annotations

import math

import numpy as np

from bench.median_noise import level_noise, pass_rate


def cells(on: list[float], off: list[float], level: int = 4) -> list[dict]:
    out = []
    for r, (a, b) in enumerate(zip(on, off)):
        out += [{"concurrency": level, "policy": "on", "goodput_tok_s": a, "round": r},
                {"concurrency": level, "policy": "off", "goodput_tok_s": b, "round": r},
                {"concurrency": level, "policy": "auto", "goodput_tok_s": 1.0, "round": r}]  # not read
    return out


def test_a_drift_shared_by_the_round_is_not_cell_noise() -> None:
    drift = [1.0, 1.5, 0.7, 1.2]
    s_e, s_d, rounds = level_noise(cells([100 * d for d in drift], [80 * d for d in drift]), 4)
    assert rounds == 4 and s_e < 1e-9  # on / off the same in every round
    assert s_d > 0.2  # the rounds moved together


def test_cell_noise_is_read_from_the_within_round_ratio() -> None:
    on, off = [100.0, 110.0, 100.0, 110.0], [100.0, 100.0, 110.0, 100.0]
    s_e, _, _ = level_noise(cells(on, off), 4)
    diffs = [math.log(a / b) for a, b in zip(on, off)]
    mean = sum(diffs) / 4
    assert math.isclose(s_e, math.sqrt(sum((d - mean) ** 2 for d in diffs) / 3) / math.sqrt(2))
    assert level_noise(cells(on, off), 8) is None  # no cells at that level


def test_identical_policies_always_pass_without_cell_noise_and_often_fail_with_it() -> None:
    rng = np.random.default_rng(1)
    assert pass_rate(0.0, 0.3, 8, 2000, rng).all()  # shared drift alone cancels
    rate = pass_rate(0.08, 0.0, 8, 4000, rng).mean()
    assert 0.6 < rate < 0.85  # a ~8 % cell noise: the median ratio of 8 rounds spreads ~5 %
