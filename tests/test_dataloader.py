"""PromptShard: disjoint covering shards, determinism, resume, bad rows, Parquet."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distflow.buffer.dataloader import BadRowPolicy, DatasetError, PromptRow, PromptShard, keep_row


def write_jsonl(path: Path, n: int, extra_lines: dict[int, str] | None = None) -> Path:
    """n good rows {"prompt": "q{i}", "answer": i}; extra_lines[k] replaces the k-th row's line."""
    lines = [json.dumps({"prompt": f"q{i}", "answer": i}) for i in range(n)]
    for k, text in (extra_lines or {}).items():
        lines[k] = text
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def data(tmp_path) -> Path:
    return write_jsonl(tmp_path / "prompts.jsonl", 103)


def all_rows(shard: PromptShard, epoch: int, local_batch: int) -> list[PromptRow]:
    steps = shard.steps_per_epoch(local_batch * shard.world_size)
    return [r for s in range(steps) for r in shard.batch(epoch, s, local_batch)]


@pytest.mark.parametrize("world", [1, 3, 4])
def test_shards_are_disjoint_and_cover_the_dataset(data, world):
    shards = [PromptShard(str(data), r, world, seed=5) for r in range(world)]
    per_rank = [[r.row_index for r in all_rows(s, 0, 8)] for s in shards]
    flat = [i for rows in per_rank for i in rows]
    assert sorted(flat) == list(range(103))  # every row once, across ranks
    for rows in per_rank:
        assert abs(len(rows) - 103 / world) < 1
    assert {s.steps_per_epoch(8 * world) for s in shards} == {-(-103 // (8 * world))}
    row = shards[0].batch(0, 0, 1)[0]
    assert row.prompt_id == f"e0:{row.row_index}" and row.data == {"prompt": f"q{row.row_index}",
                                                                  "answer": row.row_index}


def test_order_is_deterministic_per_seed_and_epoch(data):
    a = [r.row_index for r in all_rows(PromptShard(str(data), 1, 2, seed=3), 0, 10)]
    b = [r.row_index for r in all_rows(PromptShard(str(data), 1, 2, seed=3), 0, 10)]
    assert a == b
    assert a != [r.row_index for r in all_rows(PromptShard(str(data), 1, 2, seed=4), 0, 10)]
    assert a != [r.row_index for r in all_rows(PromptShard(str(data), 1, 2, seed=3), 1, 10)]
    perm = np.random.Generator(np.random.PCG64(np.random.SeedSequence([3, 0]))).permutation(103)
    assert a == perm[1::2].tolist()  # the documented definition, computed independently


def test_reserve_draws_fresh_rows_of_this_shard_deterministically(data):
    """DAPO's refill: rows of this rank's shard, never one of the step's own rows nor one an
    earlier attempt of the step drew, the same draw for the same (seed, epoch, step, attempt)
    in any process, ids that never collide with the step's."""
    s = PromptShard(str(data), 1, 3, seed=3)
    mine = s.rank_rows(0).tolist()
    assert len(mine) == 34
    own = {r.row_index for r in s.batch(0, 1, 10)}
    draws = [s.reserve(0, 1, attempt, 10, local_batch=10) for attempt in range(4)]
    rows = [[r.row_index for r in d] for d in draws]
    assert [len(r) for r in rows] == [10, 10, 4, 0]  # 34 rows - 10 of the step's own: then the shard runs out
    flat = [r for rs in rows for r in rs]
    assert len(set(flat)) == len(flat) == 24 and set(flat) == set(mine) - own  # disjoint, none of the step's
    assert all(r.prompt_id == f"e0:{r.row_index}:r1.{a}" for a, d in enumerate(draws) for r in d)
    again = PromptShard(str(data), 1, 3, seed=3)  # another process: the same draw
    assert [r.row_index for r in again.reserve(0, 1, 1, 10, local_batch=10)] == rows[1]
    assert [r.row_index for r in s.reserve(0, 2, 0, 10, local_batch=10)] != rows[0]  # the next step differs
    assert len(s.reserve(0, 1, 0, 1000, local_batch=10)) == 10  # at most a step's worth per attempt
    assert s.reserve(0, 1, 0, 0, local_batch=10) == []
    step_ids = {r.prompt_id for r in s.batch(0, 1, 10)}
    assert not step_ids & {r.prompt_id for d in draws for r in d}
    with pytest.raises(ValueError, match="must be >= 0"):
        s.reserve(0, -1, 0, 1, local_batch=10)


def test_no_shuffle_is_strided_identity(data):
    s = PromptShard(str(data), 2, 4, shuffle=False)
    assert [r.row_index for r in s.batch(0, 0, 3)] == [2, 6, 10]
    assert [r.row_index for r in s.batch(0, 8, 3)] == [98, 102]  # rank 2 owns 26 rows: a short last step
    assert s.batch(0, 9, 3) == []
    assert [r.prompt_id for r in s.batch(2, 0, 2)] == ["e2:2", "e2:6"]


def test_iterate_keeps_ranks_in_lockstep_and_resume_gives_exactly_the_rest(data):
    world, lb = 3, 4
    full = PromptShard(str(data), 0, world, seed=9)
    everything = list(full.iterate(lb, epochs=2))
    steps = full.steps_per_epoch(lb * world)
    assert [(e, s) for e, s, _ in everything] == [(e, s) for e in range(2) for s in range(steps)]
    for r in range(1, world):  # same step count on every rank
        assert len(list(PromptShard(str(data), r, world, seed=9).iterate(lb, epochs=2))) == len(everything)

    first = PromptShard(str(data), 0, world, seed=9)
    it = first.iterate(lb, epochs=2)
    head = [next(it) for _ in range(5)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    assert (state["epoch"], state["step"]) == (0, 5)
    resumed = PromptShard(str(data), 0, world, seed=9)
    resumed.load_state_dict(state)
    tail = list(resumed.iterate(lb, epochs=2))
    ids = lambda part: [r.prompt_id for _, _, rows in part for r in rows]  # noqa: E731
    assert ids(head) + ids(tail) == ids(everything)
    epoch0_rest = [r.prompt_id for e, _, rows in tail if e == 0 for r in rows]
    assert epoch0_rest == [r.prompt_id for e, s, rows in everything if e == 0 and s >= 5 for r in rows]
    assert list(resumed.iterate(lb, epochs=2)) == []  # finished


def test_resume_refuses_a_different_sharding(data):
    s = PromptShard(str(data), 0, 2, seed=1)
    other = PromptShard(str(data), 0, 3, seed=1)
    with pytest.raises(ValueError, match="world_size=2 but this loader has 3"):
        other.load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="'step' must be a non-negative int"):
        s.load_state_dict({"epoch": 0, "step": -1})


BAD = {
    3: ('{"prompt": "ok", ', "invalid JSON"),
    10: ("[1, 2, 3]", "row must be a JSON object, got list"),
    20: ('{"question": "no prompt"}', "missing required key 'prompt'"),
    30: ('{"prompt": 42}', "key 'prompt' must be str or list, got int"),
    40: ('{"prompt": null}', "key 'prompt' is null"),
}


@pytest.mark.parametrize("row", sorted(BAD))
def test_bad_row_error_names_file_and_line(tmp_path, row):
    text, problem = BAD[row]
    path = write_jsonl(tmp_path / "bad.jsonl", 50, {row: text})
    s = PromptShard(str(path), 0, 1, shuffle=False)
    assert s.num_rows == 50
    s.batch(0, 0, row)  # the rows before it are fine
    with pytest.raises(DatasetError, match=rf"bad\.jsonl:{row + 1}: {problem}"):
        s.batch(0, 0, row + 1)


@pytest.mark.parametrize("text", ['{"prompt": "x", "n": ' + "1" * 5000 + "}",  # past int's digit limit
                                  '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"],  # past the parser's depth
                         ids=["long-int", "deep-nesting"])
def test_rows_the_json_parser_refuses_otherwise_are_bad_rows_too(tmp_path, text):
    path = write_jsonl(tmp_path / "odd.jsonl", 6, {2: text})
    with pytest.raises(DatasetError, match=r"odd\.jsonl:3: invalid JSON"):
        PromptShard(str(path), 0, 1, shuffle=False).batch(0, 0, 6)
    skip = PromptShard(str(path), 0, 1, shuffle=False, bad_rows="skip")
    assert len(skip.batch(0, 0, 6)) == 5 and skip.bad_rows_skipped == 1


def test_line_numbers_count_blank_lines_and_crlf(tmp_path):
    path = tmp_path / "blank.jsonl"
    # no final newline; lines 5 and 7 hold only spaces and a tab: blank, as the docs say, not bad rows
    path.write_bytes(b'{"prompt": "a"}\r\n\r\n\n{"prompt": "b"}\n   \n{"prompt": "c"}\n\t \r\n x\n{"prompt": "d"}')
    s = PromptShard(str(path), 0, 1, shuffle=False)
    assert s.num_rows == 5
    with pytest.raises(DatasetError, match=r"blank\.jsonl:8: invalid JSON"):  # " x": not blank, and no JSON
        s.batch(0, 0, 5)
    rows = PromptShard(str(path), 0, 1, shuffle=False, bad_rows="skip").batch(0, 0, 10)
    assert [r.data["prompt"] for r in rows] == ["a", "b", "c", "d"]


def test_skip_mode_counts_bad_rows_on_this_rank_only(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", 50, {r: BAD[r][0] for r in BAD})
    per_rank = []
    for rank in range(2):
        s = PromptShard(str(path), rank, 2, shuffle=False, bad_rows="skip")
        rows = all_rows(s, 0, 7)
        per_rank.append((s.bad_rows_skipped, len(rows)))
    assert per_rank == [(4, 21), (1, 24)]  # bad rows 3 (odd) on rank 1; 10, 20, 30, 40 on rank 0


def test_only_this_ranks_rows_are_parsed(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", 20, {1: "not json"})
    s = PromptShard(str(path), 0, 2, shuffle=False)  # row 1 belongs to rank 1
    assert len(all_rows(s, 0, 5)) == 10


def test_parquet_reads_only_needed_row_groups(tmp_path):
    path = tmp_path / "prompts.parquet"
    table = pa.table({"prompt": [f"q{i}" for i in range(100)], "answer": list(range(100))})
    pq.write_table(table, path, row_group_size=16)
    s = PromptShard(str(path), 1, 2, seed=2)
    assert s.num_rows == 100 and s.steps_per_epoch(10) == 10
    rows = all_rows(s, 0, 5)
    assert [r.data for r in rows] == [{"prompt": f"q{r.row_index}", "answer": r.row_index} for r in rows]
    other = all_rows(PromptShard(str(path), 0, 2, seed=2), 0, 5)
    assert sorted(r.row_index for r in rows + other) == list(range(100))

    unshuffled = PromptShard(str(path), 0, 4, shuffle=False)
    reads = []
    orig = unshuffled._src._file.read_row_group
    unshuffled._src._file.read_row_group = lambda g, **kw: reads.append(g) or orig(g, **kw)
    assert [r.row_index for r in unshuffled.batch(0, 0, 3)] == [0, 4, 8]
    assert reads == [0]  # rows 0..8 live in the first group of 16: nothing else was read


def test_parquet_bad_rows_name_the_row(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", None, "c"]}), path)
    with pytest.raises(DatasetError, match=r"p\.parquet: row 2: key 'prompt' is null"):
        PromptShard(str(path), 0, 1, shuffle=False).batch(0, 0, 3)
    skip = PromptShard(str(path), 0, 1, shuffle=False, bad_rows="skip")
    assert [r.data["prompt"] for r in skip.batch(0, 0, 3)] == ["a", "c"] and skip.bad_rows_skipped == 1


def test_parquet_corrupt_row_group_is_bad_rows_not_a_crash(tmp_path):
    """A row group whose pages cannot be decoded (footer intact: the file opens) fails only its
    own rows: named by file, group and rows with bad_rows: error, skipped and counted with skip."""
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(8)]}), path, row_group_size=4)
    col = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = col.dictionary_page_offset or col.data_page_offset
    raw = bytearray(path.read_bytes())
    raw[start:start + col.total_compressed_size] = b"\xff" * col.total_compressed_size  # its page headers
    path.write_bytes(bytes(raw))
    with pytest.raises(DatasetError, match=r"c\.parquet: row group 1 \(rows 5-8\) cannot be read"):
        PromptShard(str(path), 0, 1, shuffle=False).batch(0, 0, 8)
    skip = PromptShard(str(path), 0, 1, shuffle=False, bad_rows="skip")
    assert [r.data["prompt"] for r in skip.batch(0, 0, 8)] == ["p0", "p1", "p2", "p3"]
    assert skip.bad_rows_skipped == 4


def test_bad_arguments_and_files(tmp_path, data):
    with pytest.raises(DatasetError, match="not found"):
        PromptShard(str(tmp_path / "missing.jsonl"), 0, 1)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unknown prompt file format"):
        PromptShard(str(tmp_path / "x.csv"), 0, 1)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="cannot open as Parquet"):
        PromptShard(str(tmp_path / "broken.parquet"), 0, 1)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\)"):
        PromptShard(str(data), 2, 2)
    with pytest.raises(ValueError, match="bad_rows must be"):
        PromptShard(str(data), 0, 1, bad_rows="ignore")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DatasetError, match="empty.jsonl: the prompt file has no rows"):
        PromptShard(str(empty), 0, 1)  # else the run would start, send nothing, and time out waiting for step 0


def test_a_later_check_rejects_a_row_through_its_loaders_policy(tmp_path, caplog):
    """A key the loader is not told of (a reward's) is checked after reading: the row names its
    file and line, and is raised or skipped and counted by the same policy, in the same counter,
    for the step's rows and the refill rows (reserve) alike."""
    lines = {2: json.dumps({"prompt": "q2"}), 7: json.dumps({"prompt": "q7", "answer": None})}
    path = write_jsonl(tmp_path / "p.jsonl", 10, lines)
    needed = {"answer": "reward 'gsm8k' (workflow node 'reward')"}
    unused = BadRowPolicy("error")  # rows a loader read never fall back to it

    skip = PromptShard(str(path), 0, 1, shuffle=False, bad_rows="skip")
    rows = skip.batch(0, 0, 5)
    assert [r.where for r in rows] == [f"{path}:{i}" for i in range(1, 6)] and len(rows) == 5
    with caplog.at_level("WARNING", logger="distflow.buffer.dataloader"):
        kept = [r.row_index for r in rows if keep_row(r, needed, unused)]
    assert kept == [0, 1, 3, 4] and skip.bad_rows_skipped == 1 and unused.skipped == 0
    assert (f"skipping bad row #1 (bad_rows: skip): {path}:3: missing key 'answer', which reward 'gsm8k' "
            f"(workflow node 'reward') reads (prompt e0:2; the row has ['prompt'])") in caplog.text
    refill = skip.reserve(0, 0, 0, 5, local_batch=5)  # rows 5..9: a null counts as missing too
    with caplog.at_level("WARNING", logger="distflow.buffer.dataloader"):
        assert sorted(r.row_index for r in refill if keep_row(r, needed, unused)) == [5, 6, 8, 9]
    assert skip.bad_rows_skipped == 2 and f"{path}:8: key 'answer' is null, which reward 'gsm8k'" in caplog.text

    strict = PromptShard(str(path), 0, 1, shuffle=False)
    with pytest.raises(DatasetError, match=rf"p\.jsonl:3: missing key 'answer', which reward 'gsm8k' \(workflow "
                                           rf"node 'reward'\) reads \(prompt e0:2; the row has \['prompt'\]\)"):
        [keep_row(r, needed, BadRowPolicy("skip")) for r in strict.batch(0, 0, 5)]

    # a row no loader read (no location, no policy): the fallback policy decides, named by prompt id
    fallback = BadRowPolicy("skip")
    assert not keep_row(PromptRow("x:1", 1, {"prompt": "q"}), needed, fallback) and fallback.skipped == 1
    assert keep_row(PromptRow("x:2", 2, {"prompt": "q", "answer": 0}), needed, fallback)
    with pytest.raises(DatasetError, match=r"^prompt x:3: missing key 'answer'.*the row has list"):
        keep_row(PromptRow("x:3", 3, [1]), needed, BadRowPolicy("error"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bad_rows must be 'error' or 'skip'"):
        BadRowPolicy("ignore")


def test_keep_row_applies_the_rewards_checks():
    """check_row: a problem is a bad row; a check that raises, or answers with no str, is a bug in
    the check, raised even under ``skip`` (else every row would be skipped quietly)."""
    who = "reward 'r' (workflow node 'reward')"
    checks = [(lambda row: None if str(row["answer"]).isdigit() else "not digits", who)]
    skip = BadRowPolicy("skip")
    assert keep_row(PromptRow("x:1", 1, {"answer": "12"}), {}, skip, checks)
    assert not keep_row(PromptRow("x:2", 2, {"answer": "a"}), {}, skip, checks) and skip.skipped == 1
    assert not keep_row(PromptRow("x:3", 3, ["a"]), {}, skip, checks) and skip.skipped == 2  # type: ignore[arg-type]
    with pytest.raises(DatasetError, match=r"^f\.jsonl:4: not digits, so reward 'r' \(workflow node 'reward'\) "
                                           r"cannot score it \(prompt x:4\)$"):
        keep_row(PromptRow("x:4", 4, {"answer": "a"}, where="f.jsonl:4"), {}, BadRowPolicy("error"), checks)
    with pytest.raises(RuntimeError, match=r"the check_row of reward 'r' .* raised on prompt x:5 .*KeyError"):
        keep_row(PromptRow("x:5", 5, {}), {}, BadRowPolicy("skip"), checks)
    backwards = [(lambda row: row["answer"].isdigit(), who)]  # a bool, not a problem: refused, not guessed
    with pytest.raises(TypeError, match=r"must return None .* or a str .*got True"):
        keep_row(PromptRow("x:6", 6, {"answer": "1"}), {}, BadRowPolicy("skip"), backwards)
