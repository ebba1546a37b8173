"""The node processes of a `distflow run` under test, found through /proc (no psutil).

Why: several tests check that a run leaves no node behind, or kill one node of it; a node's
command line names the run's ``output_dir/config.yaml``, which tells its processes apart from
every other run's on the machine.
"""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """The process exists and is no zombie (a reparented child may stay unreaped in a container)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def run_pids(out: Path, node_id: str | None = None, *, skip_zombies: bool = False) -> list[int]:
    """PIDs of the processes whose command line names the config of the run in ``out`` (only the
    node ``node_id``'s, when given; zombies left out with ``skip_zombies``)."""
    needle = str(out / "config.yaml").encode()
    ident = None if node_id is None else b" --node-id " + node_id.encode() + b" "
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            # NUL-separated for a program; one title with spaces for a node forked by distflow run
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if needle in cmd and (ident is None or ident in cmd) and (not skip_zombies or alive(int(p.name))):
            pids.append(int(p.name))
    return pids
