"""The transport's shape: backend choices in one place (transport.select), movers composed and
named, capabilities answered without probing, one replay guard for both planes."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest
import torch

from distflow.core.auth import ReplayGuard
from distflow.transport import Endpoint, make_transport, select
from distflow.transport.api import Transport

SECRET = "select-test-secret-0123456789abcdef"
ROOT = Path(__file__).resolve().parents[1]


def test_transport_kind_by_device_and_what_the_host_has() -> None:
    assert select.transport_kind("auto", cuda_node=True, nccl=True, shm=True) == "nccl"
    assert select.transport_kind("auto", cuda_node=False, nccl=True, shm=True) == "shm"  # a cpu node never opens a GPU
    assert select.transport_kind("auto", cuda_node=True, nccl=False, shm=True) == "shm"
    assert select.transport_kind("auto", cuda_node=True, nccl=False, shm=False) == "zmq"
    assert select.transport_kind("zmq", cuda_node=True, nccl=True, shm=True) == "zmq"  # explicit: kept
    with pytest.raises(ValueError, match="unknown channel kind 'tcp'"):
        select.transport_kind("tcp", cuda_node=False, nccl=False, shm=True)


def test_node_movers_per_kind() -> None:
    assert select.node_movers("zmq") == {"socket"}
    assert select.node_movers("shm") == {"socket", "shm", "posting"}
    assert select.node_movers("shm", posting=False) == {"socket", "shm"}
    assert select.node_movers("shm", local_socket=False) == {"socket", "shm"}  # posting needs the same-host socket
    assert select.node_movers("nccl") == {"socket", "shm", "posting", "nccl"}


def test_message_mover_takes_nccl_only_for_cuda_tensors_to_a_willing_peer() -> None:
    nccl = select.node_movers("nccl")
    assert select.message_mover(nccl, cuda_tensors=True, peer_refused_nccl=False) == "nccl"
    assert select.message_mover(nccl, cuda_tensors=False, peer_refused_nccl=False) == "host"
    assert select.message_mover(nccl, cuda_tensors=True, peer_refused_nccl=True) == "host"
    assert select.message_mover(select.node_movers("shm"), cuda_tensors=True, peer_refused_nccl=False) == "host"


def test_payload_mover_by_locality_and_size() -> None:
    shm = select.node_movers("shm")
    kw = dict(nbytes=1 << 20, shm_min_bytes=64 << 10, shm_ok=True, lent=False)
    assert select.payload_mover(shm, local=True, **kw) == "shm"
    assert select.payload_mover(shm, local=False, **kw) == "socket"  # another host
    assert select.payload_mover(shm, local=True, **{**kw, "nbytes": 1000}) == "socket"  # under shm_min_bytes
    assert select.payload_mover(shm, local=True, **{**kw, "nbytes": 0, "shm_min_bytes": 0}) == "socket"  # empty
    assert select.payload_mover(shm, local=True, **{**kw, "shm_ok": False}) == "socket"  # the peer cannot map
    assert select.payload_mover(shm, local=False, **{**kw, "nbytes": 10, "lent": True}) == "shm"  # lent: as is
    assert select.payload_mover(select.node_movers("zmq"), local=True, **kw) == "socket"


def test_weight_tier_is_chosen_with_the_same_facts() -> None:
    assert select.weight_tier("auto", True, True, True) == "cuda_ipc"
    assert select.weight_tier("auto", True, True, True, same_gpu=False) == "nccl"
    assert select.weight_tier("auto", True, True, True, nccl_channel=False, same_gpu=False) == "channel"
    assert select.weight_tier("auto", False, True, False) == "channel"


def test_capabilities_are_answered_not_probed() -> None:
    async def main() -> None:
        z, s = make_transport("zmq", "z", SECRET), make_transport("shm", "s", SECRET)
        await z.start()
        await s.start()
        try:
            peer = Endpoint("s", "127.0.0.1", s.port)
            assert z.movers == {"socket"} and not z.supports("shm") and not z.supports("posting")
            assert z.lend(peer, 1 << 20) is None and z.open_mailbox("samples") is None
            assert z.known_poster(peer, "samples") is None and await z.poster(peer, "samples") is None
            assert await z.shared_buffer(4096) is None and z.post(None, None, 0, b"", 0, 0) is False
            z.finish(None)  # a defined no-op
            assert s.supports("shm") and s.supports("posting") and not s.supports("nccl")
            lent = s.lend(Endpoint("z", "127.0.0.1", z.port), 1 << 20)
            assert lent is not None and lent.numel() == 1 << 20 and lent.dtype == torch.uint8
            assert s.lend(Endpoint("z", "10.255.255.1", z.port), 1 << 20) is None  # another host: no shm
            assert s.open_mailbox("samples") is not None
            with pytest.raises(ValueError, match="unknown mover 'pigeon'"):
                s.supports("pigeon")
            assert z.stats()["transport"] == "zmq" and s.stats()["transport"] == "shm"
        finally:
            await z.close()
            await s.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_explicit_kinds_refuse_keywords_of_movers_they_lack_and_auto_drops_them() -> None:
    with pytest.raises(TypeError, match="shm_min_bytes"):
        make_transport("zmq", "n", SECRET, shm_min_bytes=0)
    with pytest.raises(TypeError, match="device"):
        make_transport("shm", "n", SECRET, device=0)
    t = make_transport("auto", "n", SECRET, cuda_node=False, device=0, shm_min_bytes=0)
    assert not t.supports("nccl")


def test_data_plane_replay_guard_needs_growing_sequence_numbers_and_never_forgets() -> None:
    g = ReplayGuard(window=1, forget_after_s=None)
    assert g.check("a", (10, b"s1"), 1) == "" and g.check("a", (10, b"s1"), 2) == ""
    assert g.check("a", (10, b"s1"), 2) == "replay" and g.check("a", (10, b"s1"), 1) == "replay"
    assert g.check("a", (11, b"s2"), 1) == ""  # a newer life of the sender starts afresh
    assert g.check("a", (10, b"s1"), 3, now=1e12) == "stale"  # an older one, however long after


def _classes_and_bases(path: Path) -> dict[str, list[str]]:
    tree = ast.parse(path.read_text())
    return {n.name: [ast.unparse(b) for b in n.bases] for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def test_no_backend_subclasses_another() -> None:
    """Every class of distflow/transport derives from at most one project class, and that one is
    the API (or an error base): movers and the link are composed, never inherited."""
    allowed = {"Transport", "ChannelError", "ABC", "RuntimeError", "ValueError", "Exception"}
    for path in (ROOT / "distflow" / "transport").rglob("*.py"):
        for cls, bases in _classes_and_bases(path).items():
            project = [b for b in bases if b not in allowed and not b.startswith(("Generic", "Protocol"))]
            assert not project, f"{path.name}:{cls} subclasses {project}"
    assert issubclass(type(make_transport("zmq", "n", SECRET)), Transport)


def test_callers_never_probe_a_transport() -> None:
    """No getattr/hasattr on anything named like a channel or transport outside the package."""
    bad = []
    for path in [*(ROOT / "distflow").rglob("*.py"), *(ROOT / "bench").glob("*.py")]:
        if "transport" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
                target = ast.unparse(node.args[0]) if node.args else ""
                if "channel" in target or "transport" in target or target in ("ch", "chan"):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, bad
