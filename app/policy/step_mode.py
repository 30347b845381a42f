"""The step modes the mode arbiter chooses between ('plan': the step planner decides; 'on': every
adaptive sequence whose acceptance makes drafting the default k pay at the batch's size drafts it;
'off': every adaptive sequence decodes plainly), and how a batch of forced requests maps onto them.

Why 'on' leaves out the sequences whose acceptance cannot pay: under mixed traffic the
arbiter's 'on' otherwise drafts every class, and a class whose acceptance never pays (prose at 0.13
accepted per drafted token in the H100 sweep of bench/RESULTS.md section 7) spends draft and verify
time in every 'on' step, so 'on' loses to 'off' and auto cannot have "speculate the code, not the
prose" from a fixed mode; only the planner had it, and its choice rests on the cost model alone."""

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
                pays: list[bool] | None = None) -> StepMode | None:
    """The mode a batch with no adaptive sequence measures: 'off' when every sequence asked for
    no drafts, 'on' when every one asked for `default_k` (forced 'on') and every one would draft in
    the 'on' mode (`pays`, None: all would), else None (a mix)."""
    if any(adaptive) or not requested_ks:
        return None
    if all(k == 0 for k in requested_ks):
        return "off"
    if all(k == default_k for k in requested_ks) and (pays is None or all(pays)):
        return "on"
    return None


def mode_ks(mode: StepMode, caps: list[int], adaptive: list[bool], default_k: int,
            pays: list[bool] | None = None) -> list[int] | None:
    """Drafts per sequence for a fixed mode: adaptive sequences at `default_k` ('on', those whose
    acceptance pays at this batch size: `pays`, None: all) or 0 ('off'), forced ones at their cap as
    always; None for 'plan' (the planner decides)."""
    if mode == "plan":
        return None
    drafts = pays if pays is not None else [True] * len(caps)
    return [(min(cap, default_k) if mode == "on" and d else 0) if a else cap
            for cap, a, d in zip(caps, adaptive, drafts)]
