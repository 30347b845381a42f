"""Router <-> target replica messages (plain dataclasses: cheap to pickle across actors)."""

from __future__ import annotations

from dataclasses import dataclass

from app.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    k: int  # most drafts per step (0 = plain)
    timeout_s: float
    adaptive: bool = False  # 'auto': the engine's step planner picks 0..k each step; else k always
    alpha_prior: float | None = None  # the router's acceptance estimate for the prompt's class
    # on failover: the tokens already streamed; the new replica resumes after them (SpecEngine.add)
    output_ids: tuple[int, ...] = ()
    # the client reads tokens as they come; False: chunks serve only failover, so the target merges
    # more steps into each (app/engine/loop.py stream_gap_s)
    streaming: bool = True


@dataclass(frozen=True)
class GenerateChunk:
    """One or more engine steps' output for one request. The target replica sends a chunk per step
    while its reader keeps up, and merges the steps that waited when it does not (at tens of
    streams, thousands of chunks a second would otherwise cost more than the tokens)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    drafted: int = 0
    accepted: int = 0  # one step: the first `accepted` tokens were proposed by the draft; the rest is the target's
    k: int = 0
    replica: str = ""
    error: str | None = None  # admission refused: the router answers with `status`
    status: int = 0
    steps: tuple[tuple[int, int, int], ...] = ()  # merged steps: (tokens, drafted, accepted) each, in order
    # per token, when the request asked: (log-probability, [(alternative id, log-probability)])
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

    def parts(self) -> tuple[tuple[int, int, int], ...]:
        """(tokens, drafted, accepted) of each step in this chunk."""
        return self.steps or ((len(self.token_ids), self.drafted, self.accepted),)

    def origins(self) -> list[bool]:
        """Per token: whether the draft proposed it (the first `accepted` tokens of each step)."""
        return [i < accepted for n, _, accepted in self.parts() for i in range(n)]
