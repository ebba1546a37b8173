"""Verifiable reward functions, looked up by name from the workflow config.

Why it exists: a workflow's REWARD node names its function (``fn: gsm8k``); this module
is the registry that turns the name into a callable ``fn(response, row) -> float`` in
[0, 1]. ``response`` is the decoded completion (special tokens skipped); ``row`` is the
dataset row the prompt came from. Reward functions never raise on odd model output
(they score it 0.0). Users add their own with ``@register_reward`` or by pointing the
config at ``package.module:function``.

A reward declares the row keys it reads (``register_reward(name, required_keys=...)``, or a
``required_keys`` attribute on a ``package.module:function``): the rollout stages check every
row for them before generating, so a row without one is a bad row like any other (``bad_rows``:
an error naming file, line, key and reward, or skipped and counted, its whole prompt group
with it) instead of a failed reward stage that takes the rollout node down. A reward may also
declare ``check_row(row) -> problem or None`` for a row it cannot score though the key is there
(gsm8k: an answer that is not a number): such a row is a bad row the same way. A function that
declares nothing is called on every row; one that still meets a row without its field raises
a ValueError naming the field.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from typing import Any, Callable, Sequence

from distflow.rl.catalog import FUNCTIONS

__all__ = [
    "RewardFn",
    "extract_final_number",
    "declares",
    "register_reward",
    "registered_rewards",
    "resolve_reward",
    "reward_keys",
    "reward_value",
    "REWARD_RANGE",
    "reward_row_check",
    "row_requirements",
]

RewardFn = Callable[[str, dict], float]
REWARD_RANGE = (0.0, 1.0)  # the documented range of a reward (the built-ins'); others are counted and warned of
RowCheck = Callable[[dict], "str | None"]  # row -> why the reward cannot score it, or None
_REGISTRY: dict[str, RewardFn] = {}

# An optionally signed number with optional thousands separators and decimals: -1,234.50.
# A minus sign right after a digit or ')' is subtraction, not a sign: "8-5" -> 8, 5.
_NUMBER = re.compile(r"(?:(?<![\d)])-)?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")
_BOX_OPEN = re.compile(r"\\boxed\s*\{")
_SPACED_SIGN = re.compile(r"^(\s*)-\s+(?=[\d.\\])")  # a box that opens with "- 7" or "- \frac"
_BRACE = re.compile(r"\\\\|\\[{}]|[{}]")  # an escaped backslash or brace (not grouping), or a brace
_THIN_SPACE = re.compile(r"\\[,!;]")  # LaTeX spacing, also a thousands separator: 1\,000
_NUM_GROUP = r"\{\s*(" + _NUMBER.pattern + r")\s*\}|(\d)"  # {12} or, LaTeX's shorthand, a single digit
# [-][whole]\frac{a}{b} (also \dfrac, \tfrac, \frac12): a mixed number when a whole part comes first
_FRAC = re.compile(r"(-\s*)?(?:(\d+)\s*)?\\[dt]?frac\s*(?:" + _NUM_GROUP + r")\s*(?:" + _NUM_GROUP + ")")
_RATIO = re.compile(r"\s*(" + _NUMBER.pattern + r")\s*/\s*(" + _NUMBER.pattern + r")\s*")
_HASHES = re.compile(r"####[ \t]*(" + _NUMBER.pattern + r")")
_SENTENCE_END = re.compile(r"\n|\.(?!\d)")  # a newline, or a full stop that is no decimal point
_ANSWER = re.compile(r"answer(?:\s+is)?[\s:*]*(" + _NUMBER.pattern + r")", re.IGNORECASE)


def _key_tuple(keys: Any, owner: str) -> tuple[str, ...]:
    if isinstance(keys, str):  # one key, not its letters
        keys = (keys,)
    if not isinstance(keys, Sequence) or not all(isinstance(k, str) and k for k in keys):
        raise ValueError(f"reward {owner!r}: required_keys must be a sequence of non-empty strings (the row keys "
                         f"it reads), got {keys!r}")
    return tuple(keys)


def _row_check(check: Any, owner: str) -> RowCheck | None:
    if check is not None and not callable(check):
        raise ValueError(f"reward {owner!r}: check_row must be callable(row) -> str | None, got {check!r}")
    return check


def declares(fn: RewardFn | None = None, *, required_keys: Sequence[str] = (), check_row: RowCheck | None = None,
             owner: str = "") -> Any:
    """Decorator: set what reward ``fn`` reads of a row (``fn.required_keys``) and whether it can
    score a row at all (``fn.check_row``). The built-in rewards are named by the catalog
    (:mod:`distflow.rl.catalog`, slot ``reward``) and declare through this."""
    if fn is not None:
        owner = owner or getattr(fn, "__name__", repr(fn))
    keys, check = _key_tuple(required_keys, owner or "?"), _row_check(check_row, owner or "?")

    def deco(f: RewardFn) -> RewardFn:
        name = owner or getattr(f, "__name__", repr(f))
        for attr, value in (("required_keys", keys or None), ("check_row", check)):
            if value is None:
                continue
            try:
                setattr(f, attr, value)
            except AttributeError:
                raise ValueError(f"reward {name!r}: cannot set {attr} on {type(f).__name__} {f!r}; "
                                 f"register a plain function") from None
        return f

    return deco(fn) if fn is not None else deco


def register_reward(name: str, *, required_keys: Sequence[str] = (),
                    check_row: RowCheck | None = None) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available to workflow configs as ``name``. ``required_keys``: the row
    keys it reads, set as ``fn.required_keys``; ``check_row(row) -> problem or None``: whether it
    can score a row at all (e.g. its answer is a number), set as ``fn.check_row``. A row without
    a key, or with a problem, is a bad row (see the module doc)."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"reward name must be a non-empty string without ':', got {name!r}")
    if name in FUNCTIONS["reward"]:
        raise ValueError(f"reward {name!r} is a built-in reward")
    declare = declares(required_keys=required_keys, check_row=check_row, owner=name)

    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered (by {_REGISTRY[name].__module__})")
        _REGISTRY[name] = declare(fn)
        return fn

    return deco


def reward_keys(fn: Callable[..., float], name: str = "") -> tuple[str, ...]:
    """The row keys reward ``fn`` declares it reads (its ``required_keys``); () when it declares none."""
    keys = getattr(fn, "required_keys", ())
    return _key_tuple(keys, name or getattr(fn, "__name__", repr(fn))) if keys else ()


def reward_row_check(fn: Callable[..., float], name: str = "") -> RowCheck | None:
    """Reward ``fn``'s ``check_row`` (row -> what makes it unscorable, or None); None when it has none."""
    return _row_check(getattr(fn, "check_row", None), name or getattr(fn, "__name__", repr(fn)))


def registered_rewards() -> list[str]:
    return sorted({*FUNCTIONS["reward"], *_REGISTRY})


def resolve_reward(spec: str) -> RewardFn:
    """A registered name (``"gsm8k"``) or a dotted path (``"my_pkg.rewards:score"``) -> the function."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec in FUNCTIONS["reward"]:
        return FUNCTIONS["reward"][spec].load()
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if ":" not in spec:
        raise ValueError(f"unknown reward {spec!r}: registered rewards are {registered_rewards()} "
                         f"(or give a dotted path 'package.module:function')")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn: Any = module
    for part in attr.split("."):
        if not part or not hasattr(fn, part):
            raise ValueError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not callable ({type(fn).__name__})")
    return fn  # type: ignore[return-value]


def reward_value(value: Any) -> float:
    """A reward function's return value as a float; ValueError saying what it returned instead. A
    number (int, float, bool, numpy or a 0-d tensor) that is finite; never a string ("1.0" would
    parse, and a function returning text has a bug), None, a list or NaN."""
    if isinstance(value, (str, bytes)) or not (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        raise ValueError(f"returned {value!r:.80} ({type(value).__name__}), not a number")
    try:
        v = float(value)
    except (TypeError, ValueError) as e:  # a tensor or array of more than one element
        raise ValueError(f"returned {value!r:.80} ({type(value).__name__}), not a number: {e}") from None
    if not math.isfinite(v):
        raise ValueError(f"returned {value!r}, not a finite number")
    return v


def _field(row: dict, key: str, reward: str) -> Any:
    if not isinstance(row, dict) or key not in row:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"reward {reward!r} needs the row field {key!r}; the row has {keys}")
    return row[key]


def _to_float(text: str) -> float | None:
    s = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        v = float(s)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def _last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` that closes (braces matched, so ``\boxed{\frac{1}{2}}``
    is whole; a box left open, as in a response cut at max_new_tokens, is none), None if there is none.
    ``\{`` and ``\}`` are literal braces; of nested boxes the outer one (it closes last)."""
    opens = {m.end() - 1 for m in _BOX_OPEN.finditer(text)}
    if not opens:
        return None
    stack: list[int] = []  # positions of the open braces
    last = None
    for m in _BRACE.finditer(text):
        if m.group() == "{":
            stack.append(m.start())
        elif m.group() == "}" and stack:
            start = stack.pop()
            if start in opens:
                last = text[start + 1:m.start()]
    return last


def _ratio(a: str, b: str) -> float | None:
    num, den = _to_float(a), _to_float(b)
    return None if num is None or not den else num / den


def _boxed_number(box: str) -> float | None:
    r"""The number a box holds, None if none: of an equation (``2 \times 21 = 42``) its right-hand side;
    a box that is only ``a/b`` is a/b; else the first number
    or ``\frac{a}{b}`` (a/b; also ``\dfrac``, ``\tfrac``, ``\frac12``, a sign before it, and a mixed
    number ``2\frac{1}{2}`` = 2.5), after ``{,}`` and ``\,`` are read as LaTeX's thousands separators
    (``1{,}000`` = 1000)."""
    s = _THIN_SPACE.sub("", box.replace("{,}", ",")).rsplit("=", 1)[-1]  # an equation's result: after its last =
    s = _SPACED_SIGN.sub(r"\1-", s)  # "- 7": a sign set apart, still a sign
    whole = _RATIO.fullmatch(s)
    if whole:
        return _ratio(whole.group(1), whole.group(2))
    frac, num = _FRAC.search(s), _NUMBER.search(s)
    if frac and (num is None or frac.start() <= num.start()):
        sign, units, a1, a2, b1, b2 = frac.groups()
        v = _ratio(a1 or a2, b1 or b2)
        if v is None:
            return None
        v = int(units) + v if units else v
        return -v if sign else v
    return _to_float(num.group()) if num else None


def extract_final_number(text: str) -> float | None:
    r"""The final answer of a GSM8K-style solution, None if there is none. In order:

    1. the number in the last ``\boxed{...}`` (how instruction-tuned models such as Qwen2.5 end a
       solution; braces matched, ``\frac{1}{2}`` is 0.5 and ``1{,}000`` is 1000: :func:`_boxed_number`);
    2. the number right after the last ``####`` (the dataset's own format; only a number that
       directly follows it: ``#### Step 2: ...`` is a markdown heading, not an answer);
    3. the number right after the last "answer" / "answer is" / "answer:" (``**Final Answer:** 72``),
       or when that sentence goes on to an ``=``, the number after its last one (``answer is 5 + 3 = 8``);
    4. the last number in the text.
    """
    text = text.replace("\\$", "").replace("$", "").replace("\u2212", "-")  # U+2212, the typeset minus
    boxed = _last_boxed(text)
    value = _boxed_number(boxed) if boxed is not None else None
    if value is not None:
        return value
    found = _HASHES.findall(text)
    if found:
        return _to_float(found[-1])
    answers = list(_ANSWER.finditer(text))
    if answers:  # "answer is 5 + 3 = 8.": the result after the sentence's last '=', not its first operand
        start = answers[-1].start(1)
        stop = _SENTENCE_END.search(text, start)
        sentence = text[start:stop.start() if stop else len(text)]
        m = _NUMBER.search(sentence.rsplit("=", 1)[1]) if "=" in sentence else None
        return _to_float(m.group() if m else answers[-1].group(1))
    found = _NUMBER.findall(text)
    return _to_float(found[-1]) if found else None


def _successor_problem(row: dict) -> str | None:
    return "'answer' is empty" if not str(row.get("answer", "")).strip() else None


@declares(required_keys=("answer",), check_row=_successor_problem)
def successor(response: str, row: dict) -> float:
    """Toy task: 1.0 if the response starts with the answer digit (``row["answer"]``)."""
    answer = str(_field(row, "answer", "successor")).strip()
    if not answer:
        raise ValueError("reward 'successor': the row's 'answer' is empty")
    if not isinstance(response, str):
        return 0.0
    return 1.0 if response.strip().startswith(answer) else 0.0


def _expected_number(raw: Any) -> float | None:
    r"""A gsm8k row's answer as a number: a bare number (``"1,234"``, ``"$5"``, 72), a fraction
    (``"3/4"``, ``"rac{3}{4}"``, read as a box's content is), or a full solution ending in
    ``#### 72`` or a ``oxed{}``; None when it is none of these. (A fraction went to the
    last-number rule and was read as its denominator: 3/4 as 4.)"""
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        return None
    expected = _to_float(str(raw))
    if expected is None and isinstance(raw, str):
        if "####" in raw or "\\boxed" in raw:
            expected = extract_final_number(raw)
        else:
            expected = _boxed_number(raw.replace("\\$", "").replace("$", "").replace("\u2212", "-"))
    return expected


def _gsm8k_problem(row: dict) -> str | None:
    raw = row.get("answer")
    return None if _expected_number(raw) is not None else f"'answer' {raw!r:.60} is not a number"


@declares(required_keys=("answer",), check_row=_gsm8k_problem)
def gsm8k(response: str, row: dict) -> float:
    """1.0 if the response's final number equals the row's answer numerically.

    The row's answer may be a bare number (``"1,234"``, ``"$5"``) or a full GSM8K solution
    ending in ``#### 72``.
    """
    raw = _field(row, "answer", "gsm8k")
    expected = _expected_number(raw)
    if expected is None:
        raise ValueError(f"reward 'gsm8k': the row's 'answer' {raw!r:.60} is not a number")
    if not isinstance(response, str):
        return 0.0
    got = extract_final_number(response)
    if got is None:
        return 0.0
    return 1.0 if math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9) else 0.0


@declares(required_keys=("answer",))
def exact_match(response: str, row: dict) -> float:
    """1.0 if the stripped response equals the stripped ``str(row["answer"])``."""
    answer = _field(row, "answer", "exact_match")
    if not isinstance(response, str):
        return 0.0
    return 1.0 if response.strip() == str(answer).strip() else 0.0


def row_requirements(workflow: Sequence[Any]) -> tuple[dict[str, str], list[tuple[RowCheck, str]]]:
    """What the workflow's rule-based rewards need of a row: the keys they declare they read, each
    with who reads it (``"reward 'gsm8k' (workflow node 'reward')"``), and their ``check_row``
    functions, each with who it is. The whole workflow: a reward that runs on a worker group of
    its own is checked here, where the rows are read. A reward that cannot be resolved here is
    left to the stage that runs it, which names the problem; a reward whose declarations are
    malformed raises ValueError naming its node. Torch-free (the launcher's pre-run checks use it)."""
    keys: dict[str, list[str]] = {}
    checks: list[tuple[RowCheck, str]] = []
    for n in workflow:
        if n.role.value != "REWARD" or n.type.value != "COMPUTE":
            continue
        try:
            fn = resolve_reward(n.fn)
        except ValueError:
            continue
        who = f"reward {n.fn!r} (workflow node {n.id!r})"
        try:
            declared, check = reward_keys(fn, n.fn), reward_row_check(fn, n.fn)
        except ValueError as e:
            raise ValueError(f"workflow node {n.id!r}: {e}") from None
        for k in declared:
            keys.setdefault(k, []).append(who)
        if check is not None:
            checks.append((check, who))
    return {k: " and ".join(v) for k, v in keys.items()}, checks
