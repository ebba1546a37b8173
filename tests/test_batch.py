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
