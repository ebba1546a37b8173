"""SampleBatch: ragged selection, concatenation, wire round trip, validation."""

import pytest
import torch

from distflow.buffer.batch import SampleBatch


def batch() -> SampleBatch:
    return SampleBatch.from_lists(["a", "b", "c"], ["p", "p", "q"], [[1, 2], [1, 2], [3]], [[4], [5, 6], []],
                                  [[0.1], [0.2, 0.3], []], policy_version=[0, 1, 1], extras=[{"i": 0}, {"i": 1}, {"i": 2}])


def test_select_reorders_ragged_and_scalar_fields():
    s = batch().select([2, 1, 1])
    assert s.sample_ids == ["c", "b", "b"] and s.prompt_ids == ["q", "p", "p"]
    assert s.tensors["prompt_tokens"].tolist() == [3, 1, 2, 1, 2]
    assert s.tensors["response_tokens"].tolist() == [5, 6, 5, 6]
    assert s.tensors["logprobs"].tolist() == pytest.approx([0.2, 0.3, 0.2, 0.3])
    assert s.tensors["policy_version"].tolist() == [1, 1, 1]
    assert [e["i"] for e in s.extras] == [2, 1, 1]
    assert [t.tolist() for t in s.ragged("response_tokens")] == [[], [5, 6], [5, 6]]
    assert len(batch().select([])) == 0


def test_concat_and_wire_round_trip():
    b = batch()
    c = SampleBatch.concat([b.select([0]), SampleBatch.empty(), b.select([2, 1])])
    assert c.sample_ids == ["a", "c", "b"] and c.tensors["response_tokens"].tolist() == [4, 5, 6]
    meta, tensors = c.to_wire()
    d = SampleBatch.from_wire(meta, tensors)
    assert d.sample_ids == c.sample_ids and all(torch.equal(d.tensors[k], c.tensors[k]) for k in c.tensors)
    assert d.num_tokens().tolist() == [3, 1, 4]


def test_bad_shapes_are_named():
    b = batch()
    with pytest.raises(ValueError, match="reward"):
        b.set_scalar("reward", torch.zeros(2))
    with pytest.raises(ValueError, match="logprobs"):
        SampleBatch(["a"], ["p"], {"response_lens": torch.tensor([2]), "response_tokens": torch.tensor([1, 2]),
                                   "logprobs": torch.zeros(3)})
    with pytest.raises(ValueError, match="sample_ids"):
        SampleBatch.from_wire({"prompt_ids": []}, {})


def packed(b: SampleBatch):
    from distflow.buffer.routing import Packer

    return Packer(b).pack(list(range(len(b))))


def test_concat_of_packed_parts_and_batches_equals_concat_of_batches():
    b = batch()
    b.tensors["values"] = torch.tensor([1.5, -2.0, 0.25]).to(torch.bfloat16)  # a ragged bf16 field
    parts = [packed(b.select([2])), b.select([0]), packed(b.select([])), packed(b.select([1, 0]))]
    got = SampleBatch.concat(parts)
    want = SampleBatch.concat([b.select([2]), b.select([0]), b.select([1, 0])])
    assert got.sample_ids == want.sample_ids == ["c", "a", "b", "a"] and got.extras == want.extras
    for k, t in want.tensors.items():
        assert got.tensors[k].dtype == t.dtype and torch.equal(got.tensors[k], t), k


@pytest.mark.parametrize("bad, match", [
    (lambda lay: lay[:-1] + [lay[-1][:3]], "entries"),
    (lambda lay: [lay[0], lay[0]] + lay[2:], "distinct"),
    (lambda lay: [[lay[0][0], "complex", *lay[0][2:]], *lay[1:]], "unknown dtype"),
    (lambda lay: [[*lay[0][:2], 4, lay[0][3]], *lay[1:]], "do not fit"),  # misaligned int64
    (lambda lay: [[*lay[0][:2], lay[0][2], 10**9], *lay[1:]], "do not fit"),  # past the buffer
    (lambda lay: [[*lay[0][:2], -64, lay[0][3]], *lay[1:]], "do not fit"),
    (lambda lay: [[*lay[0][:3], 1.5], *lay[1:]], "do not fit"),
    (lambda lay: [e for e in lay if e[0] != "prompt_lens"], "needs 'prompt_lens'"),
    (lambda lay: [[*e[:3], e[3] - 1] if e[0] == "response_tokens" else e for e in lay], "flat values"),
    (lambda lay: [[*e[:3], e[3] - 1] if e[0] == "policy_version" else e for e in lay], "expected shape"),
    (lambda lay: [[["x"], *lay[0][1:]], *lay[1:]], "entries"),
])
def test_check_packed_names_what_is_wrong(bad, match):
    from distflow.buffer.batch import check_packed

    p = packed(batch())
    assert check_packed(p.layout, p.buf, 3) == p.nbytes()
    with pytest.raises(ValueError, match=match):
        check_packed(bad(p.layout), p.buf, 3)
