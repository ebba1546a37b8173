"""Wire format: signing, replay protection and rejection of bad input, counted per reason."""

from __future__ import annotations

import hashlib
import hmac
import pathlib
import struct
import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distflow.core.auth import Authenticator, ReplayGuard
from distflow.core.wire import (
    KIND_REQUEST,
    PROTOCOL_VERSION,
    Codec,
    WireError,
)

SECRET = "wire-test-secret-0123456789abcdef"


def make_pair(max_frame: int = 4096, boot_b: int = 1000):
    a = Codec(Authenticator(SECRET), "a", 500, max_frame_bytes=max_frame)
    b = Codec(Authenticator(SECRET), "b", boot_b, max_frame_bytes=max_frame)
    return a, b


def signed(payload_obj, secret: str = SECRET) -> list[bytes]:
    payload = msgpack.packb(payload_obj, use_bin_type=True)
    return [payload, Authenticator(secret).tag([payload], b"ctrl")]


def valid_map(**over):
    m = {"v": PROTOCOL_VERSION, "t": "x.y", "f": "a", "b": 7, "c": 1, "ts": int(time.time() * 1000),
         "to": "b", "ti": 0, "k": 0, "r": 0, "a": "127.0.0.1:1", "d": {}}
    m.update(over)
    return m


def reason_of(codec: Codec, frames) -> str:
    with pytest.raises(WireError) as ei:
        codec.decode(frames)
    return ei.value.reason


def test_round_trip_preserves_every_field():
    a, b = make_pair()
    body = {"x": 1, "s": "é", "l": [1, 2.5, None, b"\x00\xff"], "m": {"k": True}}
    gossip = [[0, "n1", 5, "rollout", "127.0.0.1", 9000, {"rank": 1}, 0.01]]
    frames = a.encode("app.echo", body, to="b", to_inc=1000, kind=KIND_REQUEST, req_id=42, addr="127.0.0.1:5",
                      gossip=gossip)
    env = b.decode(frames)
    assert (env.type, env.sender, env.boot, env.counter) == ("app.echo", "a", 500, 1)
    assert (env.to, env.to_inc, env.kind, env.req_id, env.addr) == ("b", 1000, KIND_REQUEST, 42, "127.0.0.1:5")
    assert env.body == body
    assert env.gossip == gossip
    assert abs(env.ts_ms - time.time() * 1000) < 5000
    # counters increase per message
    assert b.decode(a.encode("t", {}, to="b")).counter == 2


def test_tag_is_hmac_sha256_over_length_prefixed_payload():
    a, _ = make_pair()
    payload, tag = a.encode("t", {"k": 1}, to="b")
    key = hashlib.sha256(b"distflow-v1-mac" + SECRET.encode()).digest()
    expect = hmac.new(key, b"ctrl" + struct.pack("<Q", len(payload)) + payload, hashlib.sha256).digest()
    assert tag == expect and len(tag) == 32
    # the data-plane domain gives a different tag: a control tag cannot be replayed there
    assert Authenticator(SECRET).tag([payload], b"data") != tag


def test_wrong_secret_and_tampering_are_bad_mac():
    a, b = make_pair()
    other = Codec(Authenticator("another-secret-0123456789abcdef"), "a", 500)
    assert reason_of(b, other.encode("t", {}, to="b")) == "bad_mac"
    payload, tag = a.encode("t", {"v": 1}, to="b")
    flipped = bytes([payload[0]]) + bytes([payload[1] ^ 1]) + payload[2:]
    assert reason_of(b, [flipped, tag]) == "bad_mac"
    assert reason_of(b, [payload, tag[:-1] + bytes([tag[-1] ^ 0x80])]) == "bad_mac"
    assert reason_of(b, [payload, tag[:16]]) == "bad_mac"
    assert b.dropped == {"bad_mac": 4}
    # the untouched message still decodes: rejections left no state behind
    assert b.decode([payload, tag]).body == {"v": 1}


def test_replay_rejected_and_reorder_window():
    a, b = make_pair()
    msgs = [a.encode("t", {"i": i}, to="b") for i in range(5)]
    assert b.decode(msgs[0]).body == {"i": 0}
    assert reason_of(b, msgs[0]) == "replay"
    assert b.decode(msgs[3]).body == {"i": 3}
    assert b.decode(msgs[1]).body == {"i": 1}  # late but inside the window: accepted once
    assert reason_of(b, msgs[1]) == "replay"
    assert reason_of(b, msgs[3]) == "replay"
    assert b.decode(msgs[2]).counter == 3
    assert b.dropped["replay"] == 3


def test_replay_guard_window_and_boots():
    g = ReplayGuard(window=4)
    assert g.accept("s", 10, 1)
    assert g.accept("s", 10, 9)  # jump ahead
    assert not g.accept("s", 10, 5)  # 9 - 5 = 4 >= window: too old
    assert g.accept("s", 10, 6) and not g.accept("s", 10, 6)
    assert not g.accept("s", 9, 100)  # an older boot of the sender
    assert g.accept("s", 11, 1)  # the sender restarted: fresh window
    assert not g.accept("s", 10, 50)
    # a sender silent past the horizon may come back with a lower boot (clock stepped back)
    g2 = ReplayGuard(window=4, forget_after_s=300.0)
    assert g2.accept("s", 10, 1, now=0.0)
    assert not g2.accept("s", 9, 1, now=299.0)
    assert g2.accept("s", 9, 1, now=301.0) and not g2.accept("s", 9, 1, now=302.0)


def test_oversized_truncated_and_misrouted():
    a, b = make_pair(max_frame=1024)
    with pytest.raises(ValueError, match="max_frame_bytes"):
        a.encode("t", {"blob": b"x" * 2000}, to="b")
    big = signed(valid_map(d={"blob": b"x" * 2000}))
    assert reason_of(b, big) == "oversized"
    payload, tag = a.encode("t", {}, to="b")
    assert reason_of(b, [payload]) == "truncated"
    assert reason_of(b, []) == "truncated"
    assert reason_of(b, [payload, tag, b""]) == "malformed"
    assert reason_of(b, a.encode("t", {}, to="c")) == "misrouted"
    assert reason_of(b, a.encode("t", {}, to="")) == "misrouted"  # only joins may omit the destination
    assert b.decode(a.encode("swim.join", {}, to="")).type == "swim.join"
    assert b.dropped == {"oversized": 1, "truncated": 2, "malformed": 1, "misrouted": 2}


def test_signed_garbage_is_classified():
    _, b = make_pair()
    cases = {
        "malformed": [b"\xc1", b"\x93\x01\x02\x03", msgpack.packb([1, 2]), b"\x91" * 3000,
                      msgpack.packb({"t": "x"}), msgpack.packb(valid_map()) + b"\x00",
                      msgpack.packb({"v": 1, "t": "x"}), b"\xc7\x01\x05a"],
        "bad_version": [msgpack.packb(valid_map(v=2))],
        "wrong_types": [msgpack.packb(valid_map(v="1")), msgpack.packb(valid_map(t=5)),
                        msgpack.packb(valid_map(f="")), msgpack.packb(valid_map(c=-1)),
                        msgpack.packb(valid_map(b=True)), msgpack.packb(valid_map(k=9)),
                        msgpack.packb(valid_map(d=[1])), msgpack.packb(valid_map(g={"x": 1})),
                        msgpack.packb(valid_map(to=3)), msgpack.packb(valid_map(ts=1.5))],
    }
    auth = Authenticator(SECRET)
    for reason, payloads in cases.items():
        for p in payloads:
            assert reason_of(b, [p, auth.tag([p], b"ctrl")]) == reason, (reason, p[:20])
    assert b.dropped == {k: len(v) for k, v in cases.items()}


def test_stale_timestamp_and_previous_life_destination():
    a, b = make_pair(boot_b=1000)
    old = signed(valid_map(ts=int(time.time() * 1000) - 10 * 60 * 1000, c=1))
    assert reason_of(b, old) == "stale"
    with pytest.raises(WireError) as ei:
        b.decode(a.encode("t", {}, to="b", to_inc=999))
    assert ei.value.reason == "stale_dest" and ei.value.envelope is not None
    assert ei.value.envelope.sender == "a"
    assert b.decode(a.encode("t", {}, to="b", to_inc=1000)).to_inc == 1000
    assert b.decode(a.encode("t", {}, to="b", to_inc=1005)).to_inc == 1005  # later incarnations of b


def test_encode_rejects_unpackable_body_with_clear_error():
    a, _ = make_pair()
    with pytest.raises(ValueError, match="cannot be encoded"):
        a.encode("t", {"x": object()}, to="b")
    # the packer is usable afterwards
    assert len(a.encode("t", {"x": 1}, to="b")) == 2


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=4))
def test_decode_never_raises_anything_but_wire_error(frames):
    _, b = make_pair()
    with pytest.raises(WireError):
        b.decode(frames)


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=10)
                    | st.binary(max_size=10),
                    lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=4), ch, max_size=4),
                    max_leaves=20))
def test_signed_random_structures_never_crash(obj):
    _, b = make_pair()
    try:
        env = b.decode(signed(obj))
    except WireError as e:
        assert e.reason in {"malformed", "wrong_types", "bad_version", "misrouted", "stale", "replay"}
    else:  # only a well-formed envelope can pass
        assert isinstance(env.body, dict)


def test_no_pickle_in_the_control_plane():
    core = pathlib.Path(__file__).resolve().parents[1] / "distflow" / "core"
    for name in ("wire.py", "mesh.py", "node.py", "status.py", "mesh_node.py"):
        src = (core / name).read_text()
        assert "import pickle" not in src and "pickle.loads" not in src, name
