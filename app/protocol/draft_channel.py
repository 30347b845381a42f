"""The draft <-> target data plane: one TCP round trip per engine step.

Serve stays the control plane (placement, health, discovery, failover): a target replica asks
its draft replica for this channel's address through a Serve handle, then sends every step's
DraftStepRequest over a plain socket. A Serve handle call costs ~3 ms (bench/RESULTS.md),
most of an 8B step; a loopback round trip here costs tens of microseconds.

Wire format, both ways: an 8-byte little-endian length, a JSON header, then any float32 arrays
the header describes (a sampled proposal's draft distributions `[k, vocab]`). No pickle: a
peer can only send token ids and numbers. A connection first sends the draft replica's token
(handed out with the address over Serve), so only the application's own replicas are served.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from app.protocol.sampling_params import SamplingParams, StructuredOutput
from app.protocol.draft import DraftSeqDelta, DraftStepRequest, DraftStepResponse, DraftUnavailable
from app.proposers.base import FirstPass, Proposal

log = logging.getLogger(__name__)

_LEN = struct.Struct("<Q")
MAX_MESSAGE = 1 << 31


# ---- encoding ---------------------------------------------------------------------------
def _sampling_fields(p: SamplingParams) -> list | None:
    """What the draft samples with: temperature, top-p, top-k and the response format (its grammar
    constrains the proposals); None for greedy free text."""
    fmt = p.response_format
    if p.greedy and fmt is None:
        return None
    return [p.temperature, p.top_p, p.top_k, None if fmt is None else [fmt.type, fmt.schema_text]]


# greedy free text, the usual case: one shared instance (frozen) instead of a validated model per
# sequence per step (32 of them were 85 of a request's 146 us of decoding)
_GREEDY = SamplingParams()


def _sampling(fields: list | None) -> SamplingParams:
    if fields is None:
        return _GREEDY
    temperature, top_p, top_k, fmt = fields
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                          response_format=None if fmt is None else StructuredOutput(type=fmt[0], schema_text=fmt[1]))


def encode_request(r: DraftStepRequest) -> bytes:
    seqs = [[s.seq_id, s.base_len, s.base_hash, s.append, s.k, _sampling_fields(s.sampling), s.seed, s.prompt_len]
            for s in r.seqs]
    return json.dumps({"client_id": r.client_id, "seqs": seqs, "release": r.release}).encode()


def decode_request(data: bytes) -> DraftStepRequest:
    h = json.loads(data)
    seqs = [DraftSeqDelta(sid, base_len, base_hash, append, k, _sampling(s), seed, prompt_len)
            for sid, base_len, base_hash, append, k, s, seed, prompt_len in h["seqs"]]
    return DraftStepRequest(h["client_id"], seqs, h["release"])


def encode_response(r: DraftStepResponse) -> bytes:
    arrays: list[np.ndarray] = []
    proposals = {}
    for sid, p in r.proposals.items():
        shape = None
        if p.probs is not None:
            a = p.probs.detach().float().cpu().numpy()  # [k, vocab]
            arrays.append(a)
            shape = list(a.shape)
        proposals[sid] = [p.tokens, shape]
    fp = r.first_pass
    header = json.dumps({"proposals": proposals, "misses": r.misses, "draft_time_s": r.draft_time_s,
                         "first_pass": [fp.tokens, fp.sequences, fp.seconds]}).encode()
    return _LEN.pack(len(header)) + header + b"".join(a.tobytes() for a in arrays)


def decode_response(data: bytes) -> DraftStepResponse:
    (n,) = _LEN.unpack_from(data)
    h = json.loads(data[8:8 + n])
    offset = 8 + n
    proposals = {}
    for sid, (tokens, shape) in h["proposals"].items():
        probs = None
        if shape is not None:
            size = shape[0] * shape[1] * 4
            probs = torch.from_numpy(np.frombuffer(data, np.float32, shape[0] * shape[1], offset).reshape(shape).copy())
            offset += size
        proposals[sid] = Proposal(tokens, probs)
    return DraftStepResponse(proposals, h["misses"], h["draft_time_s"], FirstPass(*h["first_pass"]))


# ---- framing ----------------------------------------------------------------------------
def send_message(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


def recv_message(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_MESSAGE:
        raise ConnectionError(f"message of {n} bytes refused")
    return _recv_exact(sock, n)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


# ---- the draft replica's side -----------------------------------------------------------
class DraftChannelServer:
    """Accepts target replicas' connections and answers each step with `handle(request)`."""

    def __init__(self, handle: Callable[[DraftStepRequest], DraftStepResponse], host: str = "0.0.0.0",
                 advertise_host: str = "127.0.0.1") -> None:
        self.handle = handle
        self.token = secrets.token_hex(16)
        self._sock = socket.create_server((host, 0))
        self.address = (advertise_host, self._sock.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, name="draft-channel", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="draft-channel-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                if recv_message(conn).decode() != self.token:
                    return
                while True:
                    request = decode_request(recv_message(conn))
                    send_message(conn, encode_response(self.handle(request)))
            except (ConnectionError, OSError):
                return
            except Exception:  # noqa: BLE001 — a bad step closes this connection; the target goes plain
                log.exception("draft channel step failed")

    def close(self) -> None:
        self._closed = True
        self._sock.close()


# ---- the target replica's side ----------------------------------------------------------
class DraftChannelClient:
    """A DraftClient transport over the channel. `resolve()` returns (host, port, token) of a live
    draft replica (a Serve handle call); it is asked again after any failure. Raises DraftUnavailable
    when no draft answers within `timeout_s`; the engine then decodes plainly."""

    def __init__(self, resolve: Callable[[], tuple[str, int, str]], timeout_s: float = 3.0) -> None:
        self.resolve = resolve
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self.connects = 0

    def _connect(self) -> socket.socket:
        if self._sock is None:
            host, port, token = self.resolve()
            sock = socket.create_connection((host, port), timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_message(sock, token.encode())
            self._sock = sock
            self.connects += 1
        return self._sock

    def __call__(self, request: DraftStepRequest) -> DraftStepResponse:
        try:
            sock = self._connect()
            send_message(sock, encode_request(request))
            return decode_response(recv_message(sock))
        except Exception as e:  # noqa: BLE001 — resolve errors, timeouts, resets: all mean no draft now
            self.close()
            raise DraftUnavailable(f"draft channel: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None


def round_trip_s(client: DraftChannelClient, n: int = 100) -> float:
    """Median seconds of an empty step over the channel (a health and speed probe)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        client(DraftStepRequest("probe", []))
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
