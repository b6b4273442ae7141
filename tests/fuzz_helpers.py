"""Shared pieces of the fuzz tests (tests/test_fuzz_*.py): arguments tagged good / bad / either, the judge of one
call, and a tally of the cases tried, printed and written to test-output/fuzz-cases.json.

Every generated argument carries what the product must do with it, decided here and not by the product:
- GOOD: the call must accept it and store `expect` (the value as stored, e.g. list(gpus));
- BAD: the call must refuse it with ValueError or TypeError whose message names the argument;
- EITHER: both are fine (e.g. "3" for an int: pydantic's lax mode stores 3), but a refusal must name it too.
Anything else the call raises is a crash deeper down and fails the test.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

GOOD, BAD, EITHER = "good", "bad", "either"
OUT = Path(__file__).resolve().parent.parent / "test-output" / "fuzz-cases.json"

# Each fuzz test runs a few seconds on 2 cores; no example database in the tree (.hypothesis is ignored anyway).
FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow,
                                                                   HealthCheck.data_too_large])


@dataclass(frozen=True)
class Arg:
    value: Any
    tag: str
    expect: Any = None


def good(s: st.SearchStrategy, expect: Callable[[Any], Any] = lambda v: v) -> st.SearchStrategy[Arg]:
    return s.map(lambda v: Arg(v, GOOD, expect(v)))


def bad(s: st.SearchStrategy) -> st.SearchStrategy[Arg]:
    return s.map(lambda v: Arg(v, BAD))


def either(s: st.SearchStrategy, expect: Callable[[Any], Any]) -> st.SearchStrategy[Arg]:
    return s.map(lambda v: Arg(v, EITHER, expect(v)))


def draw_args(data: Any, spec: dict[str, tuple[st.SearchStrategy[Arg], st.SearchStrategy[Arg]]],
              max_bad: int = 2) -> dict[str, Arg]:
    """One value per argument: half the cases all good, the others with 1..max_bad arguments drawn bad."""
    names = sorted(spec)
    corrupt = data.draw(st.one_of(st.just(frozenset()),
                                  st.frozensets(st.sampled_from(names), min_size=1, max_size=max_bad)))
    return {n: data.draw(spec[n][1] if n in corrupt else spec[n][0], label=n) for n in names}


@dataclass
class Tally:
    """Cases tried by one fuzz test, by outcome."""

    name: str
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, outcome: str, n: int = 1) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + n

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def report(self, cases: str | None = None) -> None:
        """Print the tally and merge it into test-output/fuzz-cases.json (test name → counts). `cases` names the
        count that is the number of cases (default: the sum of all counts)."""
        n = self.counts.get(cases, 0) if cases else self.total
        print(f"fuzz {self.name}: {n} cases {self.counts}")
        OUT.parent.mkdir(exist_ok=True)
        try:
            known = json.loads(OUT.read_text())
        except (OSError, ValueError):
            known = {}
        known[self.name] = {"cases": n, **self.counts}
        OUT.write_text(json.dumps(known, indent=1, sort_keys=True))


def _names_argument(message: str, names: set[str]) -> bool:
    # Only the part before the offending value's repr: a drawn string may itself contain an argument's name.
    head = re.split(r"\(got |, got ", message, maxsplit=1)[0]
    return any(re.search(rf"\b{re.escape(n)}\b", head) for n in names)


def judge(call: Callable[..., Any], args: dict[str, Arg], tally: Tally, **fixed: Any) -> tuple[bool, Any]:
    """Call with the drawn values (and `fixed` ones); assert the verdict. → (accepted, return value)."""
    bad_names = {n for n, a in args.items() if a.tag == BAD}
    maybe = {n for n, a in args.items() if a.tag == EITHER}
    try:
        out = call(**fixed, **{n: a.value for n, a in args.items()})
    except (ValueError, TypeError) as e:
        assert bad_names or maybe, f"valid arguments refused: {e}"
        assert _names_argument(str(e), bad_names | maybe), f"error does not name {sorted(bad_names | maybe)}: {e}"
        assert len(str(e)) < 2000, f"error message of {len(str(e))} characters"
        tally.add("refused")
        return False, None
    assert not bad_names, f"accepted bad {sorted(bad_names)}: {[(n, args[n].value) for n in bad_names]}"
    tally.add("accepted")
    return True, out
