"""Wire format of the control plane: signed, replay-proof msgpack envelopes.

Why this module exists: every control and application message between DistFlow nodes
crosses a network that other processes can reach. A node must accept only messages made
by a holder of the cluster secret, addressed to *this* life of *this* node, and never the
same message twice; and it must survive any bytes thrown at its socket. This module is
the one place that turns bytes into a trusted :class:`Envelope` (or a counted
:class:`WireError`) and back. It knows nothing about sockets or membership.

A message is two ZeroMQ frames: ``[payload, tag]``. ``payload`` is a msgpack map::

    {"v": PROTOCOL_VERSION, "t": type, "f": sender_id, "b": sender_boot, "c": counter,
     "ts": sender_wall_ms, "to": dest_id, "ti": dest_incarnation, "k": kind, "r": req_id,
     "a": sender "host:port", "d": body map, "g": [gossip updates]}   # "g" optional

``tag`` is ``Authenticator.tag([payload], b"ctrl")``. Replay protection: ``(f, b, c)``
is unique; the receiver keeps, per sender, the newest boot nonce and a sliding window of
the counters it has accepted, and rejects anything already seen, older than the window,
or from an older boot. ``to``/``ti`` stop a message meant for one node (or for a previous
life of a node, whose boot nonce is lower) from being replayed to another, and ``ts``
bounds how long a captured message stays usable against a receiver that restarted.
No pickle: msgpack without ext types only.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack

from distflow.core.auth import TAG_SIZE, Authenticator, ReplayGuard

PROTOCOL_VERSION = 1
DOMAIN = b"ctrl"

# Message kinds (field "k").
KIND_ONEWAY, KIND_REQUEST, KIND_REPLY, KIND_ERROR = 0, 1, 2, 3

# Every reason a received message can be dropped for, by the codec or by the node.
DROP_REASONS = (
    "truncated",  # fewer frames than a message has
    "malformed",  # not a msgpack map / too many frames / missing field
    "oversized",  # payload over max_frame_bytes
    "bad_mac",  # tag does not verify with the cluster secret
    "bad_version",  # protocol version this node does not speak
    "wrong_types",  # a field (or a gossip update) has the wrong type or range
    "replay",  # (sender, boot, counter) already seen, or an older boot of the sender
    "stale",  # timestamp too far from this node's clock
    "stale_dest",  # addressed to a previous life (incarnation) of this node
    "misrouted",  # addressed to another node
    "unknown_type",  # no handler for this message type
    "overloaded",  # too many handlers in flight
    "unexpected_reply",  # a reply nobody waits for (late, or wrong peer)
    "duplicate_id",  # another live process uses this node's id
    "internal_error",  # a bug while handling a valid message (logged)
)

MAX_ID_LEN = 128
MAX_TYPE_LEN = 128
MAX_ADDR_LEN = 300
_U63 = (1 << 63) - 1


class WireError(Exception):
    """A received message was rejected. ``reason`` is one of :data:`DROP_REASONS`.

    ``envelope`` is set only for authenticated messages rejected after decoding (for
    example ``stale_dest``), so the node can tell the sender about its mistake.
    """

    def __init__(self, reason: str, detail: str = "", envelope: "Envelope | None" = None):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.envelope = envelope


@dataclass(slots=True)
class Envelope:
    """A decoded, authenticated message."""

    type: str
    sender: str
    boot: int
    counter: int
    ts_ms: int
    to: str
    to_inc: int
    kind: int
    req_id: int
    addr: str
    body: dict
    gossip: list = field(default_factory=list)


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} not allowed")


class Codec:
    """Encodes and decodes envelopes for one node (one boot of one node id).

    ``decode`` raises only :class:`WireError` and counts every rejection in ``dropped``.
    """

    def __init__(
        self,
        auth: Authenticator,
        node_id: str,
        boot: int,
        *,
        max_frame_bytes: int = 1 << 20,
        max_age_s: float = 300.0,
        replay_window: int = 256,
        addressless_types: frozenset[str] = frozenset({"swim.join"}),
    ):
        if not isinstance(node_id, str) or not 0 < len(node_id) <= MAX_ID_LEN:
            raise ValueError(f"node id must be a non-empty str of at most {MAX_ID_LEN} chars, got {node_id!r}")
        self.auth = auth
        self.node_id = node_id
        self.boot = boot
        self.max_frame_bytes = max_frame_bytes
        self.max_age_ms = int(max_age_s * 1000)
        self.addressless_types = addressless_types
        self.replay = ReplayGuard(replay_window, forget_after_s=max_age_s)
        self.dropped: Counter[str] = Counter()
        self._counter = 0
        self._packer = msgpack.Packer(use_bin_type=True)

    # ------------------------------------------------------------------ encode
    def encode(
        self,
        msg_type: str,
        body: dict,
        *,
        to: str,
        to_inc: int = 0,
        kind: int = KIND_ONEWAY,
        req_id: int = 0,
        addr: str = "",
        gossip: list | None = None,
    ) -> list[bytes]:
        """Sign one message. Raises ``ValueError`` if it cannot be packed or is too large."""
        self._counter += 1
        msg = {
            "v": PROTOCOL_VERSION, "t": msg_type, "f": self.node_id, "b": self.boot, "c": self._counter,
            "ts": int(time.time() * 1000), "to": to, "ti": to_inc, "k": kind, "r": req_id, "a": addr, "d": body,
        }
        if gossip:
            msg["g"] = gossip
        try:
            payload = self._packer.pack(msg)
        except (TypeError, ValueError, OverflowError) as e:
            self._packer.reset()
            raise ValueError(f"message {msg_type!r} to {to or addr!r} cannot be encoded: {e}") from None
        if len(payload) > self.max_frame_bytes:
            raise ValueError(
                f"message {msg_type!r} to {to or addr!r} is {len(payload)} bytes, over max_frame_bytes="
                f"{self.max_frame_bytes}"
            )
        return [payload, self.auth.tag((payload,), DOMAIN)]

    # ------------------------------------------------------------------ decode
    def decode(self, frames: Sequence[bytes]) -> Envelope:
        """Verify and parse ``[payload, tag]``. Raises only :class:`WireError`."""
        try:
            return self._decode(frames)
        except WireError as e:
            self.dropped[e.reason] += 1
            raise
        except Exception as e:  # noqa: BLE001 - the contract is "only WireError"
            self.dropped["malformed"] += 1
            raise WireError("malformed", f"{type(e).__name__}: {e}") from None

    def _decode(self, frames: Sequence[bytes]) -> Envelope:
        n = len(frames)
        if n < 2:
            raise WireError("truncated", f"expected 2 frames, got {n}")
        if n > 2:
            raise WireError("malformed", f"expected 2 frames, got {n}")
        payload, tag = frames[0], frames[1]
        if len(payload) > self.max_frame_bytes:
            raise WireError("oversized", f"payload of {len(payload)} bytes > {self.max_frame_bytes}")
        if len(tag) != TAG_SIZE or not self.auth.verify((payload,), tag, DOMAIN):
            raise WireError("bad_mac", "message not signed with this cluster's secret")
        try:
            obj = msgpack.unpackb(payload, raw=False, strict_map_key=True, ext_hook=_reject_ext)
        except Exception as e:  # noqa: BLE001 - msgpack raises many types
            raise WireError("malformed", f"not msgpack: {type(e).__name__}") from None
        if type(obj) is not dict:
            raise WireError("malformed", f"payload is a {type(obj).__name__}, not a map")
        v = obj.get("v")
        if v is None:
            raise WireError("malformed", "no protocol version")
        if type(v) is not int:
            raise WireError("wrong_types", "version is not an int")
        if v != PROTOCOL_VERSION:
            raise WireError("bad_version", f"protocol version {v}, this node speaks {PROTOCOL_VERSION}")
        try:
            t, f, b, c, ts = obj["t"], obj["f"], obj["b"], obj["c"], obj["ts"]
            to, ti, k, r, a, d = obj["to"], obj["ti"], obj["k"], obj["r"], obj["a"], obj["d"]
        except KeyError as e:
            raise WireError("malformed", f"missing field {e.args[0]!r}") from None
        g = obj.get("g", [])
        if not (type(t) is str and 0 < len(t) <= MAX_TYPE_LEN):
            raise WireError("wrong_types", "type must be a non-empty str")
        if not (type(f) is str and 0 < len(f) <= MAX_ID_LEN):
            raise WireError("wrong_types", "sender must be a non-empty str")
        for name, val in (("b", b), ("c", c), ("ts", ts), ("ti", ti), ("r", r)):
            if type(val) is not int or not 0 <= val <= _U63:
                raise WireError("wrong_types", f"field {name!r} must be an int in [0, 2**63)")
        if type(k) is not int or not KIND_ONEWAY <= k <= KIND_ERROR:
            raise WireError("wrong_types", "kind must be 0..3")
        if type(to) is not str or len(to) > MAX_ID_LEN:
            raise WireError("wrong_types", "destination must be a str")
        if type(a) is not str or len(a) > MAX_ADDR_LEN:
            raise WireError("wrong_types", "address must be a str")
        if type(d) is not dict:
            raise WireError("wrong_types", "body must be a map")
        if type(g) is not list:
            raise WireError("wrong_types", "gossip must be a list")
        env = Envelope(t, f, b, c, ts, to, ti, k, r, a, d, g)
        if to != self.node_id and not (to == "" and t in self.addressless_types):
            raise WireError("misrouted", f"addressed to {to!r}, this is {self.node_id!r}")
        now_ms = int(time.time() * 1000)
        if abs(now_ms - ts) > self.max_age_ms:
            raise WireError("stale", f"timestamp {(now_ms - ts) / 1000:.1f}s away from this node's clock")
        if not self.replay.accept(f, b, c):
            raise WireError("replay", f"counter {c} of {f!r} (boot {b}) already seen or too old")
        if 0 < ti < self.boot:
            raise WireError("stale_dest", f"addressed to a previous life of {self.node_id!r}", env)
        return env
