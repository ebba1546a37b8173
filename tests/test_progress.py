"""The hang watch's positions (distflow.progress): a rank's beat and the collectives it called in the
stage, gossiped; a rank behind another's collective is stuck; a collective every rank entered and none
left is a hung group, named with the collective. On hand-made positions, and on a real gloo collective
left pending because one rank entered it and never posted."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from distflow.progress import (PUBLISH, STEP_DONE, Pending, Progress, ProgressWatch, beat_of, describe_position,
                               position_of)

pytestmark = pytest.mark.unit

UPDATE = beat_of(2, 3)  # step 2, the train half's stage 2


def test_a_position_counts_collectives_only_in_the_train_half_and_only_for_its_own_beat():
    assert position_of({"beat": UPDATE, "coll": [UPDATE, 7]}) == (UPDATE, 7)
    assert position_of({"beat": UPDATE, "coll": [UPDATE - 1, 7]}) == (UPDATE, 0)  # the count of the stage before
    assert position_of({"beat": beat_of(2, 0), "coll": [beat_of(2, 0), 1]}) == (beat_of(2, 0), 0)  # its samples
    assert position_of({"beat": beat_of(2, PUBLISH), "coll": [beat_of(2, PUBLISH), 9]}) == (beat_of(2, PUBLISH), 0)
    assert position_of({"beat": beat_of(2, STEP_DONE), "coll": [beat_of(2, STEP_DONE), 2]})[1] == 0
    assert position_of({"beat": UPDATE, "coll": "7"}) == (UPDATE, 0)  # malformed: the beat alone
    assert position_of({"coll": [UPDATE, 7]}) is None  # no beat yet
    assert describe_position((UPDATE, 7), "update") == "step 2 (update, after 7 collectives)"
    assert describe_position((beat_of(2, PUBLISH), 0)) == "step 2 (publish)"


def test_a_rank_that_did_not_reach_my_collective_is_named_after_hang_s():
    watch = ProgressWatch(hang_s=4.0)
    ahead, behind = (UPDATE, 6), (UPDATE, 5)
    assert watch.check({"t0": ahead, "t1": behind}, 10.0, "t0", "trainer") is None  # seen behind from now
    assert watch.check({"t0": ahead, "t1": (UPDATE, 6)}, 12.0, "t0", "trainer") is None  # it caught up
    assert watch.check({"t0": ahead, "t1": behind}, 13.0, "t0", "trainer") is None  # behind again: from 13
    lost, why = watch.check({"t0": ahead, "t1": behind}, 17.0, "t0", "trainer", {"t0": "update", "t1": "update"})
    assert lost == ["t1"]
    assert why.startswith("trainer rank t1 is stuck: its progress stayed at step 2 (update, after 5 collectives) "
                          "for 4s while t0 reached step 2 (update, after 6 collectives) (hang_timeout_s)")
    # the one ahead is waiting for me, not stuck: it is never named by me
    assert ProgressWatch(4.0).stuck({"t0": behind, "t1": ahead}, "t0", 100.0) == []


def test_a_collective_every_rank_entered_is_a_hung_group_after_hang_s_and_one_not_entered_is_not():
    watch = ProgressWatch(hang_s=4.0)
    pending = Pending(UPDATE, 6, "all_gather", 3 * 2**20, 4.0)
    lost, why = watch.check({"t0": (UPDATE, 6), "t1": (UPDATE, 6)}, 0.0, "t0", "trainer", {"t0": "update"}, pending)
    assert lost == ["t1"]
    assert why == ("the trainer group is hung in collective 6 (all_gather, 3.00 MiB) of step 2 (update): every rank "
                   "entered it (t0, t1) and it has not completed on t0 for 4s (hang_timeout_s): the trainer group "
                   "cannot go on; treated as a dead rank")
    young = Pending(UPDATE, 6, "all_gather", 0, 3.9)
    assert ProgressWatch(4.0).check({"t0": (UPDATE, 6), "t1": (UPDATE, 6)}, 0.0, "t0", "trainer", pending=young) is None
    # t1 has not entered it: not a hung collective (rule 1 names t1 once it stayed behind hang_s)
    assert not ProgressWatch(4.0).hung({"t0": (UPDATE, 6), "t1": (UPDATE, 5)}, "t0", pending)
    # a collective pending at the step's start (the ranks wait for their samples there) is never a hang
    at_start = Pending(beat_of(2, 0), 1, "all_reduce", 0, 600.0)
    assert not ProgressWatch(4.0).hung({"t0": (beat_of(2, 0), 0), "t1": (beat_of(2, 0), 0)}, "t0", at_start)
    assert not ProgressWatch(4.0).hung({"t0": (UPDATE, 6)}, "t0", pending)  # alone: nobody to wait for


def test_a_real_gloo_collective_one_rank_entered_without_posting_stays_pending_until_it_posts():
    """Two gloo ranks (threads of this process, a HashStore): rank 0 calls an all-reduce; rank 1 has
    entered it (counted) but hangs before posting. Rank 0's work is really pending; after hang_s both
    positions are at it and rank 0's watch names the hung collective. Once rank 1 posts, it completes
    and nothing is pending."""
    store, groups = dist.HashStore(), {}

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=30))

    threads = [threading.Thread(target=join, args=(r,), name=f"gloo-{r}") for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    now = [100.0]
    p0, p1 = Progress(clock=lambda: now[0]), Progress(clock=lambda: now[0])
    for p in (p0, p1):
        p.mark(UPDATE)
        for _ in range(3):  # three collectives done in the stage already
            p.left(p.enter("all_gather"))
    x0 = torch.ones(4)
    entry = p0.enter("all_reduce", 16)
    p0.issued(entry, groups[0].allreduce([x0]))
    hanging = p1.enter("all_reduce", 16)  # rank 1 "inside" the collective, never posting
    now[0] += 5.0
    pending = p0.oldest_pending()
    assert pending == (UPDATE, 4, "all_reduce", 16, 5.0)
    positions = {"trainer-0": p0.position(), "trainer-1": p1.position()}
    assert positions == {"trainer-0": (UPDATE, 4), "trainer-1": (UPDATE, 4)}
    lost, why = ProgressWatch(4.0).check(positions, now[0], "trainer-0", "trainer", {"trainer-0": "update"}, pending)
    assert lost == ["trainer-1"] and "hung in collective 4 (all_reduce" in why and "for 5s" in why
    x1 = torch.full((4,), 2.0)
    work = groups[1].allreduce([x1])  # rank 1 posts at last
    work.wait()
    p1.issued(hanging, work)
    t_end = time.monotonic() + 10
    while p0.oldest_pending() is not None:
        assert time.monotonic() < t_end, "the all-reduce never completed"
        time.sleep(0.01)
    assert x0.tolist() == [3.0] * 4 and p1.oldest_pending() is None
    assert p0.ops == {"all_gather": 3, "all_reduce": 1}
