"""Reading the drafter's directories defensively: drafter versions, checkpoints, lineage heads and exports.

Every file is checked before it is used, and every failure is a `DrafterFileError` (a ValueError) naming
the file: missing, unreadable, JSON that is not an object or holds NaN / Infinity, a safetensors file
whose header or size is damaged, whose CRC-32 differs from the one recorded beside it when it was written
(any flipped byte), or whose tensors have other names, shapes or dtypes than the config says, or hold
non-finite values. Callers therefore catch one type and keep the previous good directory: `load_latest`
falls back to the previous checkpoint, a lineage pull to the previous head, a version store to the last
good promoted version.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open


class DrafterFileError(ValueError):
    """A drafter, checkpoint, lineage-head, version or export file is missing or damaged; names the path."""


def file_crc32(path: str | Path, chunk: int = 1 << 24) -> int:
    """CRC-32 of a file's bytes (about as fast as reading them; detects any flipped or truncated byte)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:40]} is out of range")
    return v


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A JSON object from `path`; NaN / Infinity, any other top-level type, or bad UTF-8 refused."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise DrafterFileError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DrafterFileError(f"{path}: unreadable: {e}") from None
    try:
        obj = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:
        raise DrafterFileError(f"{path}: not valid JSON: {str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise DrafterFileError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def check_crc(path: Path, recorded: Any) -> None:
    """Compare the file's CRC-32 with the one recorded when it was written (None: written before CRCs)."""
    if recorded is None:
        return
    if isinstance(recorded, bool) or not isinstance(recorded, int) or not 0 <= recorded < 2**32:
        raise DrafterFileError(f"{path}: recorded CRC-32 {str(recorded)[:40]!r} is not a 32-bit integer")
    try:
        actual = file_crc32(path)
    except OSError as e:
        raise DrafterFileError(f"{path}: unreadable: {e}") from None
    if actual != recorded:
        raise DrafterFileError(f"{path}: CRC-32 {actual:08x} differs from the {recorded:08x} recorded when it was "
                               "written (truncated or altered)")


def read_tensors(path: str | Path, device: str | torch.device = "cpu", crc: Any = None,
                 expect: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, checked: its CRC-32 (when recorded), its header, and with `expect`
    (name → (shape, dtype)) exactly those names and shapes, dtypes of the same kind (any float for a float,
    else equal); every floating tensor finite."""
    path = Path(path)
    if not path.is_file():
        raise DrafterFileError(f"{path}: missing")
    check_crc(path, crc)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = list(f.keys())
            if expect is not None:
                _check_header(path, f, names, expect)
            tensors = {n: f.get_tensor(n) for n in names}
    except DrafterFileError:
        raise
    except (SafetensorError, OSError, RuntimeError, ValueError, TypeError, OverflowError) as e:
        raise DrafterFileError(f"{path}: not a readable safetensors file: {str(e)[:200]}") from None
    for n, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise DrafterFileError(f"{path}: tensor {n} holds NaN or infinite values")
    if str(device) != "cpu":
        tensors = {n: t.to(device) for n, t in tensors.items()}
    return tensors


def _check_header(path: Path, f: Any, names: list[str], expect: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    missing, unexpected = sorted(set(expect) - set(names)), sorted(set(names) - set(expect))
    if missing or unexpected:
        raise DrafterFileError(f"{path}: missing tensors {missing[:10]}, unexpected {unexpected[:10]}")
    for n in names:
        sl = f.get_slice(n)
        shape, dtype = tuple(sl.get_shape()), _DTYPES.get(sl.get_dtype())
        want_shape, want_dtype = expect[n]
        if shape != tuple(want_shape):
            raise DrafterFileError(f"{path}: tensor {n} has shape {list(shape)}, the config says {list(want_shape)}")
        same_kind = dtype is not None and (dtype == want_dtype or (dtype.is_floating_point and want_dtype.is_floating_point))
        if not same_kind:
            raise DrafterFileError(f"{path}: tensor {n} is {sl.get_dtype()}, expected {str(want_dtype)[6:]}")


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def finite_number(path: Path, field: str, value: Any, lo: float = -math.inf, hi: float = math.inf,
                  integer: bool = False) -> Any:
    """A JSON field's value checked: a number (an int where `integer`), finite, within [lo, hi]."""
    ok = (not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
          and math.isfinite(value) and lo <= value <= hi)
    if not ok:
        raise DrafterFileError(f"{path}: field {field} must be {'an integer' if integer else 'a number'} in "
                               f"[{lo}, {hi}], got {str(value)[:40]!r}")
    return value
