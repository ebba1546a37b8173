"""The scaling model (distflow/sim): its engine against hand-computed schedules, its routing against
the nodes' own routing, the single controller's saturation against its closed form, and (with
real processes, ``cluster``) its prediction of a small real run."""

from __future__ import annotations

import math
import os
import random
import sys

import pytest
import torch

from distflow.buffer.batch import SampleBatch
from distflow.buffer.routing import split_by_owner
from distflow.sim.calibrate import Calibration, fit
from distflow.sim.cluster import (collectives_s, controller_cpu_formula, controller_saturation_n, generation_s,
                                  make_batches, route, simulate)
from distflow.sim.costs import TABLES, CostTable, Network, Workload
from distflow.sim.engine import Cores, Engine, Fifo, fifo_finish
from distflow.sim.local import LocalStep, predict

ZERO = Calibration(remote_tx_s=0, remote_rx_s=0, remote_tx_s_per_byte=0, remote_rx_s_per_byte=0, post_tx_s=0,
                   post_rx_s=0, pack_s_per_byte=0, join_s_per_byte=0, scatter_s=0, take_s=0, wake_s=0,
                   mesh_cpu_fraction=0)


def test_fifo_serves_in_arrival_order_with_latency():
    eng = Engine()
    link = Fifo(eng, "l", rate=2.0, latency=0.5)  # 2 units/s
    ends = []
    eng.at(0.0, lambda: link.submit(2.0, lambda: ends.append(("a", eng.now))))  # 0 -> 1, delivered 1.5
    eng.at(0.5, lambda: link.submit(2.0, lambda: ends.append(("b", eng.now))))  # waits: 1 -> 2, at 2.5
    eng.at(3.0, lambda: link.submit(1.0, lambda: ends.append(("c", eng.now))))  # idle again: 3 -> 3.5, at 4.0
    eng.run()
    assert ends == [("a", 1.5), ("b", 2.5), ("c", 4.0)]
    assert link.busy == pytest.approx(2.5)


def test_fifo_finish_closed_form():
    assert fifo_finish([0.0, 0.5, 3.0], [1.0, 1.0, 0.5]) == pytest.approx(3.5)
    assert fifo_finish([3.0, 0.0, 0.5], 1.0) == pytest.approx(4.0)  # any order in, served by arrival
    from distflow.sim.cluster import fifo_finish_columns
    import numpy as np

    rng = random.Random(1)
    arr = np.array([[rng.random() for _ in range(3)] for _ in range(5)])
    cost = np.array([[rng.random() / 4 for _ in range(3)] for _ in range(5)])
    got = fifo_finish_columns(arr, cost)
    for t in range(3):
        assert got[t] == pytest.approx(fifo_finish(list(arr[:, t]), list(cost[:, t])))


def test_cores_share_by_processor_sharing():
    eng = Engine()
    cpu = Cores(eng, cores=2)
    ends = {}
    for p in ("a", "b", "c"):  # three 1-second jobs on 2 cores: each at 2/3, all end at 1.5
        cpu.submit(p, 1.0, lambda p=p: ends.__setitem__(p, eng.now))
    eng.run()
    assert ends == {"a": pytest.approx(1.5), "b": pytest.approx(1.5), "c": pytest.approx(1.5)}
    assert sum(cpu.cpu.values()) == pytest.approx(3.0)
    # one process runs its jobs one after another; a second process arriving later shares the core
    eng, ends = Engine(), []
    cpu = Cores(eng, cores=1)
    cpu.submit("a", 1.0, lambda: ends.append(("a1", eng.now)))
    cpu.submit("a", 1.0, lambda: ends.append(("a2", eng.now)))
    eng.at(0.5, lambda: cpu.submit("b", 0.5, lambda: ends.append(("b", eng.now))))
    eng.run()
    # 0-0.5: a1 alone (0.5 done); 0.5-1.5: a1 and b at 1/2 each: both done at 1.5; then a2 alone to 2.5
    assert ends == [("a1", pytest.approx(1.5)), ("b", pytest.approx(1.5)), ("a2", pytest.approx(2.5))]


def test_local_two_workers_exact_schedule():
    """N=2, generation 1.0 / 2.0 s, update 0.5 s, a 0.1 s scatter and a 0.05 s take: hand-computed."""
    cal = Calibration(**{**ZERO.to_json(), "scatter_s": 0.1, "take_s": 0.05, "source": "test"})
    st = LocalStep(n=2, samples=4, sample_bytes=1000, gen_s=(1.0, 2.0), update_s=0.5)
    wall, cpu = predict("distflow", st, cal, cores=2)
    # producer 1 scatters 2.0 -> 2.1; both consumers take 2.1 -> 2.15 (2 cores, 2 processes); update to 2.65
    assert wall == pytest.approx(2.65)
    assert cpu == pytest.approx(2 * 0.1 + 2 * 0.05)
    wall1, _ = predict("distflow", st, cal, cores=1)  # one core: the two takes share it: 2.1 -> 2.2
    assert wall1 == pytest.approx(2.7)
    wall_s, cpu_s = predict("single", st, cal, cores=2)  # the relay adds a take and a scatter on the controller
    assert wall_s == pytest.approx(2.0 + 0.1 + (0.05 + 0.1) + 0.05 + 0.5)
    assert cpu_s == pytest.approx(2 * 0.1 + 0.15 + 2 * 0.05)


def test_cluster_two_workers_exact_step():
    """N=2 on one host, only the posting and split costs non-zero: the step is max(gen) + split +
    the posts' receive + take + the slower rank's update + collectives + weight sync."""
    cal = Calibration(**{**ZERO.to_json(), "scatter_s": 0.01, "post_tx_s": 0.001, "post_rx_s": 0.002,
                         "take_s": 0.004, "source": "test"})
    cost, wl, net = TABLES["7b"], Workload(sample_tokens=2048), Network()
    r = simulate("distflow", 2, cost, wl, net, cal)
    batches = make_batches(2, wl, 0, 0)
    gen = [generation_s(b, cost) for b in batches]
    tokens = [0, 0]
    for p, b in enumerate(batches):
        for t, g in enumerate(route(b, 2)):
            tokens[t] += sum(b[i].tokens for i in g)
    exposed, sync = collectives_s(2, cost, net)
    # each producer's split (0.01 + 2 posts) posts its parts; a trainer receives them in arrival order
    # (0.002 each: both at once when both producers hit the length cap), then takes the step
    ready = fifo_finish([g + 0.012 for g in gen], 0.002) + 0.004
    assert r.step_s == pytest.approx(ready + max(tokens) / cost.train_tok_s + exposed + sync)
    assert r.gen_s == pytest.approx(max(gen))


def test_generation_is_bound_by_throughput_or_the_longest_response():
    cost = CostTable("t", 1e9, gen_tok_s=100.0, seq_tok_s=10.0, prefill_tok_s=1e9, train_tok_s=1.0)
    mk = make_batches(1, Workload(sample_tokens=64, prompts_per_worker=1, group_size=1), 0)[0]
    s = mk[0]
    assert generation_s([s], cost) == pytest.approx(s.prompt_len / 1e9 + s.response_len / 10.0)  # one sequence
    many = [type(s)(f"x{i}", 0, 50, 0) for i in range(100)]
    assert generation_s(many, cost) == pytest.approx(50.0)  # 5,000 tokens at 100/s beats 50 at 10/s


def _real_batch(samples) -> SampleBatch:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (s.prompt_len,), generator=g).tolist() for s in samples]
    resps = [torch.randint(0, 1000, (s.response_len,), generator=g).tolist() for s in samples]
    lps = [[-0.5] * s.response_len for s in samples]
    b = SampleBatch.from_lists([s.sample_id for s in samples], [s.sample_id.rsplit(":", 1)[0] for s in samples],
                               prompts, resps, lps)
    b.tensors["ref_logprobs"] = torch.ones(sum(s.response_len for s in samples))  # the fp32 loss mask
    n = len(samples)
    b.set_scalar("last_version", torch.zeros(n, dtype=torch.int64))
    b.set_scalar("truncated", torch.zeros(n, dtype=torch.int64))
    b.set_scalar("rewards", torch.zeros(n))
    b.set_scalar("advantages", torch.zeros(n))
    return b


def test_simulated_parts_are_the_routing_modules_parts():
    """The model's per-owner samples and bytes equal ``routing.split_by_owner`` on the same ids."""
    wl = Workload(sample_tokens=256, prompts_per_worker=3, group_size=4)
    for n in (3, 8):
        for r, batch in enumerate(make_batches(n, wl, seed=5)):
            real = split_by_owner(_real_batch(batch), n)
            groups = route(batch, n)
            assert [[batch[i].sample_id for i in g] for g in groups] == [p.sample_ids for p in real]
            assert [sum(batch[i].nbytes for i in g) for g in groups] == [p.nbytes() for p in real]


def test_token_balance_rotated_by_producer_spreads_what_unrotated_piled_onto_low_ranks():
    wl = Workload(sample_tokens=1024, prompts_per_worker=1, group_size=4)
    n = 16
    batches = make_batches(n, wl, seed=1)
    loads = {b: [0] * n for b in ("tokens_unrotated", "tokens")}
    for bal in loads:
        for r, batch in enumerate(batches):
            for t, g in enumerate(route(batch, n, bal, r)):
                loads[bal][t] += sum(batch[i].tokens for i in g)
    assert all(x == 0 for x in loads["tokens_unrotated"][4:])  # 4 samples per producer: ranks 4.. got nothing
    assert sum(1 for x in loads["tokens"] if x) == n


def test_route_by_tokens_rotates_each_producers_partition_by_its_rank():
    """The real groups_for: the heaviest part of producer r goes to consumer r mod N."""
    import torch

    from distflow.buffer.batch import SampleBatch
    from distflow.buffer.redistribute import groups_for

    lens = [9, 1, 5, 3]  # heaviest first: part 0 = [0], part 1 = [2], part 2 = [3], part 3 = [1]
    batch = SampleBatch.from_lists([f"s{i}" for i in range(4)], ["p"] * 4, [[1]] * 4,
                                   [[1] * n for n in lens], [[0.0] * n for n in lens])
    assert groups_for(batch, 4, "tokens", source_rank=0) == [[0], [2], [3], [1]]
    assert groups_for(batch, 4, "tokens", source_rank=1) == [[1], [0], [2], [3]]
    assert groups_for(batch, 4, "tokens", source_rank=6) == [[3], [1], [0], [2]]
    assert torch.equal(batch.num_tokens(), torch.tensor([10, 2, 6, 4]))


def test_single_controller_cpu_and_link_match_the_closed_form():
    cal = Calibration(**{**ZERO.to_json(), "remote_tx_s": 100e-6, "remote_rx_s": 80e-6, "remote_tx_s_per_byte": 1e-9,
                         "remote_rx_s_per_byte": 1e-9, "pack_s_per_byte": 0.1e-9, "scatter_s": 500e-6,
                         "source": "test"})
    cost, wl, net = TABLES["32b"], Workload(sample_tokens=2048), Network()
    for n in (16, 64):
        for mode in ("per_batch", "gathered"):
            r = simulate("single", n, cost, wl, net, cal, controller=mode)
            per_worker = r.bytes / n
            assert r.router_cpu_s == pytest.approx(controller_cpu_formula(n, per_worker, cal, mode), rel=1e-9)
            assert r.router_link_s == pytest.approx(r.bytes / net.inter_bytes_s, rel=1e-9)  # one NIC, each way
    # the N at which the per-batch controller's CPU per step reaches a budget solves the quadratic
    b = 1.5e6
    n_star = controller_saturation_n(60.0, b, cal)
    assert controller_cpu_formula(int(round(n_star)), b, cal) == pytest.approx(60.0, rel=0.01)
    assert cal.remote_tx_s * n_star ** 2 < 60.0  # the N x N part messages dominate but are not all of it


def test_fit_reads_the_benches_json_lines():
    lines = {"message_zmq_64k": {"payload_kib": 64, "channel_tx_us": 164.0, "channel_rx_us": 142.0},
             "message_zmq_1m": {"payload_kib": 1024, "channel_tx_us": 462.0, "channel_rx_us": 379.0},
             "redistribute": {"p2p_producer_cpu_ms_2": 1.07, "p2p_producer_cpu_ms_8": 1.10,
                              "p2p_consumer_cpu_ms_2": 0.77, "p2p_consumer_cpu_ms_8": 0.96,
                              "controller_cpu_ms_2": 1.9, "controller_cpu_ms_8": 5.9},
             "mesh": {"idle_cpu_fraction": 0.16, "idle_nodes": 16}}
    cal = fit(lines)
    assert cal.remote_tx_s_per_byte == pytest.approx((462 - 164) * 1e-6 / (960 * 1024))
    assert cal.remote_tx_s == pytest.approx(164e-6 - cal.remote_tx_s_per_byte * 64 * 1024)
    assert cal.post_tx_s == pytest.approx(0.03e-3 / 6) and cal.post_rx_s == pytest.approx(0.19e-3 / 6)
    assert cal.mesh_cpu_fraction == pytest.approx(0.01)
    assert cal.pack_s_per_byte > 0 and cal.scatter_s > 0 and cal.take_s > 0


def test_distflow_has_no_router_and_scales_its_routing_linearly():
    cal = Calibration()
    cost, wl, net = TABLES["7b"], Workload(sample_tokens=2048), Network()
    small, big = (simulate("distflow", n, cost, wl, net, cal) for n in (16, 256))
    assert small.router_cpu_s == 0 and big.router_cpu_s == 0
    assert big.route_s < 0.5  # a producer sends 256 parts: milliseconds each, in parallel across producers
    single = simulate("single", 256, cost, wl, net, cal)
    assert single.router_cpu_s > 256 * 256 * cal.remote_tx_s  # N x N parts from one process


@pytest.mark.cluster
def test_small_validation_run_agrees_with_the_model():
    """N=2 real processes (bench/redistribute.py's harness, sleeps for compute) against the model with
    the default calibration (this machine's, as bench/scale.py measured it). Wall time within 15%;
    CPU within 40% (a loaded 2-core host moves CPU per step by 20-30% from run to run)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
    from scale_validate import SAMPLE_BYTES, measure

    m = measure(2, 16, reps=3, base=0.2, spread=0.1, update_s=0.1)
    st = LocalStep(2, 16, SAMPLE_BYTES, tuple(m["gen_s"]), m["update_s"])
    for d in ("distflow", "single"):
        wall, cpu = predict(d, st, Calibration(), cores=os.cpu_count() or 1)
        assert math.isclose(wall, m[f"{d}_wall_s"], rel_tol=0.15), (d, wall, m)
        assert math.isclose(cpu, m[f"{d}_cpu_s"], rel_tol=0.40), (d, cpu, m)
