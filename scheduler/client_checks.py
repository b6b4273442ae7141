"""Input checks of the client's calls: a bad argument raises ValueError (TypeError for a wrong kind of
argument) at the call, naming it, so what reaches the client's buffer always encodes and round-trips: no
NaN/inf that JSON would turn into null, no text that is not UTF-8, no name that would break a Redis key."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticSerializationError
from tailspec.core import state
from tailspec.core.state import Sample

MAX_SAMPLE_IDS = 1 << 20  # prompt + response ids of one sample: far above any RL context, far below Redis' limits
MAX_TEXT = 4096  # characters of a worker name, group id or policy path
_NAME = re.compile(state.NAME_PATTERN)


def first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "(value)"
    return f"{loc}: {err['msg']} (got {short(err.get('input'))})"


def short(v: Any, limit: int = 120) -> str:
    """repr cut to `limit` characters: an error about a million-id list must not be a megabyte long."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + f"... ({len(r)} characters)"


def check_name(what: str, v: Any) -> None:
    """Cluster and node names go into Redis keys and '{node}:{gpu}' ids: state.NAME_PATTERN only."""
    if not isinstance(v, str):
        raise TypeError(f"{what} must be a str, got {type(v).__name__}")
    if not _NAME.match(v):
        raise ValueError(f"{what} must match {state.NAME_PATTERN} (letters, digits, _ . -), got {short(v)}")


def check_text(what: str, v: Any) -> None:
    """A free-form name (worker, policy path, group id): non-empty, printable, UTF-8, at most MAX_TEXT."""
    if not isinstance(v, str):
        raise TypeError(f"{what} must be a str, got {type(v).__name__}")
    if not v.strip() or len(v) > MAX_TEXT or not v.isprintable():
        raise ValueError(f"{what} must be 1 to {MAX_TEXT} printable characters, got {short(v)}")
    check_utf8(what, v)


def check_utf8(what: str, v: str) -> None:
    try:
        v.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode text (lone surrogate), got {short(v)}") from None


def check_count(what: str, v: Any, minimum: int = 0) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{what} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {v}")


def check_finite(what: str, v: Any) -> None:
    """NaN and infinity are not JSON: pydantic would write them as null, which the reader then refuses."""
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{what} must be a finite number, got {v}")


def check_seconds(what: str, v: Any, positive: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, got {type(v).__name__}")
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{what} must be a finite number of seconds {'> 0' if positive else '>= 0'}, got {v}")


def encodes(call: str, payload: Any) -> bytes:
    """The JSON the writer thread will send; a payload that does not encode is refused here, not there."""
    try:
        return state.encode(payload)
    except PydanticSerializationError as e:  # text that is not UTF-8
        raise ValueError(f"{call}: payload does not encode as JSON: {e}") from None


def checked_sample(i: int, s: Any) -> tuple[Sample, bytes]:
    """Validate (again, for a Sample built or changed without validation) and encode sample `i`."""
    where = f"submit_samples: samples[{i}]"
    if isinstance(s, Sample):
        s = s.model_dump()
    if not isinstance(s, Mapping):
        raise TypeError(f"{where} must be a Sample or dict, got {type(s).__name__}")
    try:
        sample = Sample.model_validate(s)
    except ValidationError as e:
        raise ValueError(f"{where}.{first_error(e)}") from None
    for name in ("reward", "ts"):
        check_finite(f"{where}.{name}", getattr(sample, name))
    n = len(sample.prompt_ids) + len(sample.response_ids)
    if n > MAX_SAMPLE_IDS:
        raise ValueError(f"{where}: prompt_ids + response_ids hold {n} ids, more than {MAX_SAMPLE_IDS}")
    if sample.group_id is not None:
        if len(sample.group_id) > MAX_TEXT:
            raise ValueError(f"{where}.group_id: longer than {MAX_TEXT} characters ({len(sample.group_id)})")
        check_utf8(f"{where}.group_id", sample.group_id)
    return sample, encodes(where, sample)
