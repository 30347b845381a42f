"""The step modes the mode arbiter chooses between ('plan': the step planner decides; 'on': every
adaptive sequence drafts at the default k, unless none of them has an acceptance that makes drafting
pay at the batch's size, and then none does; 'off': every adaptive sequence decodes plainly), and
how a batch of forced requests maps onto them.

Why 'on' stands down when no sequence pays: under mixed traffic a batch of prose alone (0.13 accepted
per drafted token in the H100 sweep of bench/RESULTS.md section 7) spends draft and verify time in
every 'on' step for nothing, so 'on' lost to 'off' at every load and auto could not have "speculate
the code, not the prose" from a fixed mode (at one stream a batch is one request). Why all draft once
one pays: a pass is as wide as its widest row (ModelRunner.step pads every row to it), so a sequence
that would not pay alone costs only its draft rows in a drafting step, and its accepted tokens come
nearly free.
"""

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


def forced_mode(requested_ks: list[int], adaptive: list[bool], default_k: int,
                on_drafts: bool = True) -> StepMode | None:
    """The mode a batch with no adaptive sequence measures: 'off' when every sequence asked for
    no drafts, 'on' when every one asked for `default_k` (forced 'on') and the 'on' mode would draft
    for this batch (`on_drafts`), else None (a mix)."""
    if any(adaptive) or not requested_ks:
        return None
    if all(k == 0 for k in requested_ks):
        return "off"
    if all(k == default_k for k in requested_ks) and on_drafts:
        return "on"
    return None


def mode_ks(mode: StepMode, caps: list[int], adaptive: list[bool], default_k: int,
            on_drafts: bool = True) -> list[int] | None:
    """Drafts per sequence for a fixed mode: adaptive sequences at `default_k` ('on', when some
    sequence's acceptance pays: `on_drafts`) or 0 ('off', or 'on' when none pays), forced ones at
    their cap as always; None for 'plan' (the planner decides)."""
    if mode == "plan":
        return None
    drafts = mode == "on" and on_drafts
    return [(min(cap, default_k) if drafts else 0) if a else cap for cap, a in zip(caps, adaptive)]
