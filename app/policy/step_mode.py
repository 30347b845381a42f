"""The step modes the mode arbiter chooses between ('plan': the step planner decides; 'on' / 'off': every
adaptive sequence drafts at the default k / decodes plainly, as forced 'on' / 'off' do), and how a batch of
forced requests maps onto them."""

from __future__ import annotations

from typing import Literal

StepMode = Literal["plan", "on", "off"]
MODES: tuple[StepMode, ...] = ("plan", "on", "off")
HISTORY_DEPENDENT: frozenset[StepMode] = frozenset({"plan"})  # measured only on batches that ran in it alone


def batch_bucket(batch_size: int) -> int:
    """The load bucket the mode arbiter judges a step in: 1, 2, then the next power of two (3-4 -> 4,
    9-16 -> 16): a closed-loop batch wavers by a sequence or two (c or c - 1 streams), and each
    bucket needs enough steps to learn."""
    return 1 << max(batch_size - 1, 0).bit_length()


def forced_mode(requested_ks: list[int], adaptive: list[bool], default_k: int) -> StepMode | None:
    """The mode a batch with no adaptive sequence measures: 'off' when every sequence asked for
    no drafts, 'on' when every one asked for `default_k` (forced 'on'), else None (a mix)."""
    if any(adaptive) or not requested_ks:
        return None
    if all(k == 0 for k in requested_ks):
        return "off"
    if all(k == default_k for k in requested_ks):
        return "on"
    return None


def mode_ks(mode: StepMode, caps: list[int], adaptive: list[bool], default_k: int) -> list[int] | None:
    """Drafts per sequence for a fixed mode: adaptive sequences at `default_k` ('on') or 0 ('off'),
    forced ones at their cap as always; None for 'plan' (the planner decides)."""
    if mode == "plan":
        return None
    return [(min(cap, default_k) if mode == "on" else 0) if a else cap for cap, a in zip(caps, adaptive)]
