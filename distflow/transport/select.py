"""Where the data plane's backend is chosen: for samples and weights alike, by locality and device.

Why one module: which mover carries bytes between two nodes follows from the same facts for a
sample part and for a weight bucket (same host? same GPU? CUDA tensors? an NCCL-capable node?),
and when those rules lived in two places they drifted. Every choice is a pure function here:

* :func:`transport_kind` - the transport a node builds ("zmq" | "shm" | "nccl") from the config's
  ``channel`` and the node's device (``auto``: NCCL where cupy and a GPU are present and the node
  runs on CUDA, shared memory where /dev/shm exists, ZeroMQ frames otherwise);
* :func:`node_movers` - the movers that transport has (every transport speaks the link's inline
  frames, so any two interoperate);
* :func:`message_mover` - per message: NCCL for CUDA tensors on a transport with the NCCL mover
  (unless the peer refused a communicator lately), else the host way;
* :func:`payload_mover` - per host payload: a shared-memory slot to a same-host peer (a lent slot
  always, else from ``shm_min_bytes``), else socket frames (streamed from ``stream_min_bytes``);
* :func:`weight_tier` - per (serving trainer, rollout peer) pair: ``cuda_ipc`` | ``nccl`` | ``channel``.

:func:`distflow.transport.make_transport` builds a transport from these answers.
"""

from __future__ import annotations

KINDS = ("zmq", "shm", "nccl", "auto")
WEIGHT_TIERS = ("auto", "channel", "cuda_ipc", "nccl")


def transport_kind(kind: str, *, cuda_node: bool, nccl: bool, shm: bool) -> str:
    """The transport a node builds. ``cuda_node``: the node computes on CUDA (a cpu node never takes
    NCCL: the NCCL mover opens the process's GPU, and NCCL only moves CUDA tensors); ``nccl``: cupy
    with NCCL and a GPU are present; ``shm``: /dev/shm is usable. An explicit kind is kept."""
    if kind not in KINDS:
        raise ValueError(f"unknown channel kind {kind!r}; expected one of {', '.join(KINDS)}")
    if kind != "auto":
        return kind
    if nccl and cuda_node:
        return "nccl"
    return "shm" if shm else "zmq"


def node_movers(kind: str, *, posting: bool = True, local_socket: bool = True) -> frozenset[str]:
    """The movers a transport of ``kind`` has: the socket always; shared memory (and posting, which
    needs the same-host socket for its introductions and doorbell) for shm and nccl; NCCL for nccl."""
    if kind not in ("zmq", "shm", "nccl"):
        raise ValueError(f"unknown transport kind {kind!r}")
    movers = {"socket"}
    if kind in ("shm", "nccl"):
        movers.add("shm")
        if posting and local_socket:
            movers.add("posting")
    if kind == "nccl":
        movers.add("nccl")
    return frozenset(movers)


def message_mover(movers: frozenset[str], *, cuda_tensors: bool, peer_refused_nccl: bool) -> str:
    """"nccl" when the message's CUDA tensors go GPU to GPU, else "host" (shared memory or frames;
    CUDA tensors are then copied to host memory first)."""
    return "nccl" if "nccl" in movers and cuda_tensors and not peer_refused_nccl else "host"


def payload_mover(movers: frozenset[str], *, local: bool, nbytes: int, shm_min_bytes: int, shm_ok: bool,
                  lent: bool) -> str:
    """"shm" for a payload in a shared-memory slot, else "socket" (inline frames or chunks).

    A payload viewing a slot it was lent goes as it is (zero copy); otherwise shared memory takes
    non-empty payloads of ``shm_min_bytes`` and more to a same-host peer whose slots work (``shm_ok``)."""
    if "shm" not in movers:
        return "socket"
    if lent:
        return "shm"
    return "shm" if nbytes > 0 and nbytes >= shm_min_bytes and shm_ok and local else "socket"


def weight_tier(setting: str, same_host: bool, trainer_cuda: bool, rollout_cuda: bool,
                nccl_channel: bool = True, same_gpu: bool = True) -> str:
    """The tier for one (serving trainer, rollout peer) pair: "channel" | "cuda_ipc" | "nccl".

    ``auto``: cuda_ipc when both run on one GPU (``same_gpu``, on ``same_host``: a process
    cannot open IPC handles of a GPU it does not see, and each node sees only its own), nccl
    between different GPUs, on one host or across hosts, when the data plane has the NCCL mover
    (``nccl_channel``: ``channel: nccl``, or ``auto`` with cupy), channel otherwise (GPU buckets
    then go through pinned host memory). An explicit GPU tier that the two ends or the transport
    cannot carry is a clear error (nccl between two nodes of one GPU too: NCCL refuses a
    communicator with two ranks on one device).
    """
    if setting not in WEIGHT_TIERS:
        raise ValueError(f"weight_transport must be one of {WEIGHT_TIERS}, got {setting!r}")
    both = trainer_cuda and rollout_cuda
    one_gpu = same_host and same_gpu
    if setting == "auto":
        return ("cuda_ipc" if one_gpu else "nccl" if nccl_channel else "channel") if both else "channel"
    if setting in ("cuda_ipc", "nccl") and not both:
        raise ValueError(f"weight_transport: {setting} needs CUDA on the trainer and the rollout node")
    if setting == "nccl" and one_gpu:
        raise ValueError("weight_transport: nccl between two nodes on one GPU: NCCL refuses two ranks of a "
                         "communicator on one device; use cuda_ipc (or auto, which picks it there)")
    if setting == "nccl" and not nccl_channel:
        raise ValueError("weight_transport: nccl needs the NCCL data channel (channel: nccl or auto, with cupy "
                         "installed); this node's channel is not one")
    if setting == "cuda_ipc" and not same_host:
        raise ValueError("weight_transport: cuda_ipc needs the trainer and the rollout node on one host")
    if setting == "cuda_ipc" and not one_gpu:
        raise ValueError("weight_transport: cuda_ipc needs the trainer and the rollout node on one GPU (each node "
                         "sees only its own GPU, and IPC handles open only there); use nccl or auto")
    return setting
