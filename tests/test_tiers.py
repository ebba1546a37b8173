"""The tiers (tests/conftest.py): every test has exactly one of unit / cluster / gpu, read from
what the test does, and `-m` selects them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import conftest
from tests.conftest import TIERS, _starts_processes


def starts(fn) -> bool:
    return _starts_processes(fn.__code__, fn.__globals__, set())


def test_every_collected_test_has_exactly_one_tier(request) -> None:
    items = request.session.items
    assert items
    for item in items:
        marked = [t for t in TIERS if item.get_closest_marker(t)]
        assert len(marked) == 1 and dict(item.user_properties)["tier"] == marked[0], (item.nodeid, marked)


def test_the_reader_sees_processes_started_directly_through_helpers_and_classes() -> None:
    from tests import test_elastic, test_multihost, test_supervise

    assert starts(test_elastic.test_killed_rollout_is_covered_and_rejoins)  # via its start() helper: Popen
    assert starts(test_supervise.start_run)
    assert starts(test_multihost.Nodes.start)  # a method: Popen inside `ip netns exec`
    assert starts(test_multihost.mesh_view)  # subprocess.run
    # `from tests.test_elastic import start` inside the test; distflow.launch.children.spawn in a helper
    assert starts(test_supervise.test_rollout_nodes_stop_promptly_when_the_trainer_dies_on_a_hand_started_cluster)
    from tests import test_launcher_errors

    assert starts(test_launcher_errors.sleeper)
    assert not starts(test_launcher_errors.test_node_exit_status_of_configuration_and_data_errors)

    def spawns_ranks():
        import torch.multiprocessing as mp

        mp.spawn(print, nprocs=2)

    def runs_a_cluster(args):
        return conftest.run_distflow(args, timeout=1)

    def forks_ranks():
        import torch.multiprocessing as mp

        mp.start_processes(print, nprocs=2, start_method="fork")

    def pure(x):
        return [sys.executable, x.run()]  # names `run`, but no process module

    assert starts(spawns_ranks) and starts(forks_ranks) and starts(runs_a_cluster) and not starts(pure)
    assert not starts(test_every_collected_test_has_exactly_one_tier)


KNOWN = {
    "tests/test_cluster.py::test_quickstart_accounts_for_every_sample": "cluster",
    "tests/test_multihost.py::test_mesh_forms_across_three_hosts": "cluster",  # by its `lab` fixture
    "tests/test_deploy.py::test_pdsh_bad_config_starts_nothing_and_says_why": "cluster",  # by `pdsh_run`
    "tests/test_algorithm_configs.py::test_shipped_algorithm_learns[ppo]": "cluster",  # a process per run
    "tests/test_algorithm_configs.py::test_config_validates_and_plans[ppo]": "unit",
    "tests/test_losses.py::test_loss_aggregation_errors_name_the_key": "unit",
    "tests/test_cluster.py::test_quickstart_learns_on_one_gpu[float32]": "gpu",
}


def test_minus_m_unit_selects_only_the_unit_tests() -> None:
    """`pytest -m unit --collect-only` on known tests of every tier lists exactly the unit ones."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "unit",
                        *KNOWN], cwd=conftest.ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    listed = sorted(ln for ln in r.stdout.splitlines() if ln.startswith("tests/") and "::" in ln)
    assert listed == sorted(n for n, t in KNOWN.items() if t == "unit"), listed


def test_the_tier_of_known_tests(request) -> None:
    """Where the session collected them (the whole suite, or this file with them), their tier."""
    items = {item.nodeid: dict(item.user_properties)["tier"] for item in request.session.items}
    present = {n: t for n, t in KNOWN.items() if n in items}
    if not present:
        pytest.skip("none of the known tests is collected in this session")
    assert {n: items[n] for n in present} == present
