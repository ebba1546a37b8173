"""Reward functions on real model-like strings: right, wrong, garbage, and bad rows."""

from __future__ import annotations

import sys
import types

import pytest

from distflow.rollout import rewards
from distflow.rollout.rewards import (
    extract_final_number,
    register_reward,
    registered_rewards,
    resolve_reward,
    reward_keys,
    reward_row_check,
)


def test_builtins_are_registered() -> None:
    assert {"successor", "gsm8k", "exact_match"} <= set(registered_rewards())


@pytest.mark.parametrize(
    "response,expected",
    [
        ("8", 1.0),
        ("  8\n", 1.0),
        ("89+", 1.0),  # starts with the right digit; the rest does not matter
        ("7", 0.0),
        ("=8", 0.0),
        ("", 0.0),
        ("   ", 0.0),
        ("\x00\ufffd8", 0.0),
    ],
)
def test_successor(response: str, expected: float) -> None:
    assert resolve_reward("successor")(response, {"prompt": "3947=", "answer": "8"}) == expected


@pytest.mark.parametrize(
    "response,answer,expected",
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72", 1.0),
        ("#### 72", "#### 72", 1.0),  # a full GSM8K solution as the row's answer
        ("She sold 48 + 24 = 72 clips in total.", "72", 1.0),  # no '####': the last number
        ("The total is $1,234.", "1234", 1.0),
        ("#### $1,234.00", "$1,234", 1.0),
        ("It costs 18 dollars.", 18, 1.0),  # numeric answer in the row
        ("#### 0.5", "1/2 is .5 so #### .5", 1.0),
        ("x = -3", "-3", 1.0),
        ("8-5", "5", 1.0),  # subtraction, not a negative number
        ("#### 72 because 70 + 2", "72", 1.0),  # the number right after '####' wins
        ("so 72 ... #### 71", "72", 0.0),
        ("She sold 72 clips, then 5 more.", "72", 0.0),  # the LAST number is the answer
        ("I don't know", "72", 0.0),
        ("####", "72", 0.0),
        ("", "72", 0.0),
        ("9" * 400, "72", 0.0),  # huge number: no overflow, no crash
        ("\ufffd\x00#### NaN inf", "72", 0.0),
        # how instruction-tuned models end a solution
        ("#### Step 2: Total\nSo 70 + 2 = 72.\n\\boxed{72}", "72", 1.0),  # a markdown heading, then a box
        ("The answer is $\\boxed{1,234}$.", "1234", 1.0),
        ("\\boxed{\\$18} for 2 shirts", "18", 1.0),  # the box wins over a later number
        ("**Final Answer: 72** (in 2 months)", "72", 1.0),
        ("The answer is 72. It took 2 months.", "72", 1.0),
        ("#### Step 2: then 9", "9", 1.0),  # no number right after '####': the last number
        ("\\boxed{72} ... \\boxed{71}", "72", 0.0),  # the LAST box
        ("The answer is 5 + 3 = 8.", "8", 1.0),  # the result after '=', not the first operand
        ("Answer: 3 boxes * $4 = $12", "12", 1.0),
        ("The answer is 3.5 hours. Then 2 = 2.", "3.5", 1.0),  # the '=' of another sentence is not it
        # a box with braces inside: matched, not skipped for the last number of the text
        ("Half of it: \\boxed{\\frac{1}{2}} of 4 pies", "0.5", 1.0),
        ("So \\boxed{1{,}000} dollars, 2 weeks", "1000", 1.0),
        # a fraction as the row's answer is its value, not its denominator (3/4 read as 4)
        ("\\boxed{\\frac{3}{4}}", "3/4", 1.0),
        ("\\boxed{0.75}", "\\frac{3}{4}", 1.0),
        ("4", "3/4", 0.0),
        ("\\boxed{\\frac{1}{2}}", "$1/2$", 1.0),
        ("so \\boxed{6}", "blah \\boxed{6}", 1.0),
        # a sign set apart, and the typeset minus (U+2212)
        ("\\boxed{- 7}", "-7", 1.0),
        ("\\boxed{- 7}", "7", 0.0),
        ("The answer is \u22125.", "-5", 1.0),
        ("\\boxed{3 - 5}", "3", 1.0),  # not a sign: the first number of the box, as before
    ],
)
def test_gsm8k(response: str, answer: object, expected: float) -> None:
    assert resolve_reward("gsm8k")(response, {"answer": answer}) == expected


@pytest.mark.parametrize(
    "response,answer,expected",
    [("Paris", "Paris", 1.0), ("  Paris\n", "Paris ", 1.0), ("paris", "Paris", 0.0), ("42", 42, 1.0),
     ("Paris, France", "Paris", 0.0), ("", "", 1.0)],
)
def test_exact_match(response: str, answer: object, expected: float) -> None:
    assert resolve_reward("exact_match")(response, {"answer": answer}) == expected


def test_extract_final_number() -> None:
    assert extract_final_number("a 1,000,000 b") == 1_000_000.0
    assert extract_final_number("3 then 4.25.") == 4.25
    assert extract_final_number("#### -7") == -7.0
    assert extract_final_number("no digits") is None


@pytest.mark.parametrize(
    "text,expected",
    [
        ("\\boxed{\\frac{1}{2}}", 0.5),
        ("\\boxed{\\dfrac{3}{4}} hours", 0.75),  # \dfrac, \tfrac: the same fraction
        ("\\boxed{-\\tfrac{3}{8}}", -0.375),
        ("\\boxed{\\frac{-3}{8}}", -0.375),
        ("\\boxed{\\frac72}", 3.5),  # LaTeX's shorthand for \frac{7}{2}
        ("\\boxed{2\\frac{1}{4}}", 2.25),  # a mixed number: 2 + 1/4
        ("\\boxed{x = \\frac{3}{8}}", 0.375),
        ("So \\boxed{2 \\times 21 = 42 \\text{ eggs}}", 42.0),  # an equation: its right-hand side
        ("\\boxed{16 - 3 - 4 = 9}", 9.0),
        ("\\boxed{1{,}000}", 1000.0),  # LaTeX's thousands comma
        ("\\boxed{1{,}234{,}567}", 1234567.0),
        ("\\boxed{1\\,234}", 1234.0),  # a thin space as thousands separator
        ("\\boxed{3/4}", 0.75),  # a box that is only a ratio
        ("\\boxed{\\text{72 apples}}", 72.0),
        ("\\boxed{\\{3\\}}", 3.0),  # escaped braces are literal, not grouping
        ("\\boxed{12} first, finally \\boxed{\\frac{7}{2}}", 3.5),  # the LAST box
        ("\\boxed{\\frac{7}{2}} then cut off: \\boxed{\\frac{9}{", 3.5),  # a box left open is none
        ("\\boxed{\\boxed{5}}", 5.0),
        ("\\boxed {6}", 6.0),
        ("\\boxed{\\frac{1}{0}} #### 7", 7.0),  # no number in the box: the next rule
        ("\\boxed{\\text{none}} #### 7", 7.0),
        ("}} stray \\boxed{4} {{", 4.0),
    ],
)
def test_boxed_answers_with_braces_inside(text: str, expected: float) -> None:
    assert extract_final_number(text) == pytest.approx(expected, rel=1e-12, abs=0)


def test_boxed_parse_is_linear_on_hostile_text() -> None:
    import time

    t0 = time.perf_counter()
    assert extract_final_number("\\boxed{" * 100_000 + "1") == 1.0  # no box closes: the last number
    assert extract_final_number("{" * 100_000 + "}" * 100_000 + "\\boxed{2}") == 2.0
    assert time.perf_counter() - t0 < 5.0


def test_rewards_declare_the_row_keys_they_read(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("successor", "gsm8k", "exact_match"):
        assert reward_keys(resolve_reward(name)) == ("answer",)

    @register_reward("test_reads_label", required_keys="label")  # one key, not its letters
    def reads_label(response: str, row: dict) -> float:
        return float(response == row["label"])

    assert reads_label.required_keys == ("label",) and reward_keys(reads_label) == ("label",)
    with pytest.raises(ValueError, match="required_keys must be a sequence of non-empty strings"):
        register_reward("test_bad_keys", required_keys=("answer", ""))
    # a package.module:function declares them as an attribute; one that declares none still works
    mod = types.ModuleType("distflow_test_keyed_rewards")
    mod.undeclared = lambda response, row: 1.0  # type: ignore[attr-defined]
    mod.declared = lambda response, row: float(response == row["gold"])  # type: ignore[attr-defined]
    mod.declared.required_keys = ("gold", "prompt")  # type: ignore[attr-defined]
    mod.broken = lambda response, row: 0.0  # type: ignore[attr-defined]
    mod.broken.required_keys = 5  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "distflow_test_keyed_rewards", mod)
    assert reward_keys(resolve_reward("distflow_test_keyed_rewards:undeclared")) == ()
    assert resolve_reward("distflow_test_keyed_rewards:undeclared")("x", {}) == 1.0
    assert reward_keys(resolve_reward("distflow_test_keyed_rewards:declared")) == ("gold", "prompt")
    with pytest.raises(ValueError, match=r"reward 'x:broken': required_keys must be .*got 5"):
        reward_keys(resolve_reward("distflow_test_keyed_rewards:broken"), "x:broken")


@pytest.mark.parametrize("name", ["successor", "gsm8k", "exact_match"])
def test_row_without_answer_names_the_key(name: str) -> None:
    with pytest.raises(ValueError, match=rf"reward '{name}' needs the row field 'answer'.*\['prompt'\]"):
        resolve_reward(name)("8", {"prompt": "3947="})


def test_gsm8k_non_numeric_answer_is_a_row_error() -> None:
    with pytest.raises(ValueError, match="not a number"):
        resolve_reward("gsm8k")("#### 3", {"answer": "three"})


def test_rewards_check_the_rows_they_can_score(monkeypatch: pytest.MonkeyPatch) -> None:
    """``check_row``: the rollout stages refuse such a row as a bad row before it is generated."""
    gsm8k, successor = resolve_reward("gsm8k"), resolve_reward("successor")
    assert reward_row_check(gsm8k)({"answer": "three"}) == "'answer' 'three' is not a number"
    assert reward_row_check(gsm8k)({"answer": [7]}) == "'answer' [7] is not a number"
    for ok in ("1,234", "$5", 72, 2.5, "Natalia sold ... #### 72"):
        assert reward_row_check(gsm8k)({"answer": ok}) is None, ok
    assert reward_row_check(successor)({"answer": "  "}) == "'answer' is empty"
    assert reward_row_check(successor)({"answer": "4"}) is None
    assert reward_row_check(resolve_reward("exact_match")) is None  # any answer is fine to compare

    monkeypatch.setattr(rewards, "_REGISTRY", dict(rewards._REGISTRY))  # this test's registrations end with it

    @register_reward("test_checked", check_row=lambda row: None if row.get("label") in ("a", "b") else "bad label")
    def checked(response: str, row: dict) -> float:
        return float(response == row["label"])

    assert reward_row_check(checked)({"label": "c"}) == "bad label"
    with pytest.raises(ValueError, match="check_row must be callable"):
        register_reward("test_bad_check", check_row="yes")  # type: ignore[arg-type]
    # a package.module:function declares it as an attribute; a malformed one is named at start-up
    mod = types.ModuleType("distflow_test_checked_rewards")
    mod.checked = lambda response, row: 1.0  # type: ignore[attr-defined]
    mod.checked.check_row = lambda row: None if row.get("gold") else "no gold"  # type: ignore[attr-defined]
    mod.broken = lambda response, row: 0.0  # type: ignore[attr-defined]
    mod.broken.check_row = "yes"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "distflow_test_checked_rewards", mod)
    assert reward_row_check(resolve_reward("distflow_test_checked_rewards:checked"))({}) == "no gold"
    from distflow.core.config import ConfigError, config_from_dict
    from distflow.launch.preflight import check_functions

    wf = [{"id": "generate", "role": "ACTOR", "type": "MODEL_INFERENCE", "fn": "generate"},
          {"id": "reward", "role": "REWARD", "type": "COMPUTE", "fn": "distflow_test_checked_rewards:broken",
           "deps": ["generate"]},
          {"id": "advantage", "role": "ACTOR", "type": "COMPUTE", "fn": "grpo", "deps": ["reward"]},
          {"id": "update", "role": "ACTOR", "type": "MODEL_TRAIN", "fn": "grpo", "deps": ["advantage"]}]
    cfg = config_from_dict({"model_path": "unused", "dataset": "unused.jsonl", "prompts_per_step": 2, "workflow": wf})
    with pytest.raises(ConfigError, match=r"workflow node 'reward': reward 'distflow_test_checked_rewards:broken': "
                                         r"check_row must be callable"):
        check_functions(cfg)


def test_non_string_response_scores_zero() -> None:
    for name in ("successor", "gsm8k", "exact_match"):
        assert resolve_reward(name)(None, {"answer": "1"}) == 0.0  # type: ignore[arg-type]


def test_resolve_unknown_lists_registered_names() -> None:
    with pytest.raises(ValueError, match=r"unknown reward 'nope'.*'exact_match'.*'gsm8k'.*'successor'"):
        resolve_reward("nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        resolve_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        resolve_reward("distflow.rollout.rewards:missing")
    with pytest.raises(ValueError, match="not callable"):
        resolve_reward("distflow.rollout.rewards:_REGISTRY")


def test_register_and_dotted_path(monkeypatch: pytest.MonkeyPatch) -> None:
    @register_reward("test_length_le_3")
    def short(response: str, row: dict) -> float:
        return 1.0 if len(response) <= 3 else 0.0

    assert resolve_reward("test_length_le_3") is short
    assert resolve_reward("test_length_le_3")("abc", {}) == 1.0
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_length_le_3")(lambda r, row: 0.0)
    with pytest.raises(ValueError, match="without ':'"):
        register_reward("a:b")

    mod = types.ModuleType("distflow_test_user_rewards")
    mod.contains_cat = lambda response, row: float("cat" in response)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "distflow_test_user_rewards", mod)
    fn = resolve_reward("distflow_test_user_rewards:contains_cat")
    assert fn("a cat", {}) == 1.0 and fn("a dog", {}) == 0.0
