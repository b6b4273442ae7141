"""Bad input, fuzzed: configuration values through every source (`--set key=value`, TAILSPEC_* environment, the
YAML file) for every field of every section: wrong types, out-of-range and huge numbers, NaN / inf, empty and
NUL-bearing text, integers too long to print, unknown keys. Each load either refuses with ConfigError naming the
key path, or accepts a configuration that is whole: every number finite and within its field's bounds, and it
round-trips through `tailspec config show`'s YAML unchanged. Nothing else is raised.

Case counts: printed, and written to test-output/fuzz-cases.json.
"""

from __future__ import annotations

import math

import annotated_types as at
import yaml
from fuzz_helpers import FUZZ, Tally
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from tailspec.core.config import ConfigError, TailspecConfig, dump_config, load_config

CASES = 400


def _fields() -> list[tuple[str, str]]:
    out = []
    for sec, f in TailspecConfig.model_fields.items():
        if isinstance(f.default, BaseModel):
            out += [(sec, name) for name in type(f.default).model_fields]
        else:
            out.append(("", sec))
    return out


FIELDS = _fields()
RAW = st.one_of(
    st.sampled_from(["nan", ".nan", "NaN", "inf", ".inf", "-.inf", "1e400", "-1e400", "-1", "0", "1", "-0.5", "0.5",
                     "1e308", "99999999999999999999999", "1" * 5000, "0x10", "abc", "", " ", "null", "~", "true",
                     "[1, 2]", "{a: 1}", "- x", "'quoted'", "a\x00b", "2024-01-01", "1e-3", "65536", "4097",
                     "redis://h:1/0", "rediss://:pw@h:6380/0?ssl_ca_certs=/ca.pem", "http://h", "redis://h:99999",
                     "redis://:pw@/0", "unix:///tmp/r.sock", "x" * 300, "*", "&a [1]", "!!python/object:os.system"]),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=12),
)


def _bounds(section: str, name: str) -> tuple[float, float]:
    model = type(TailspecConfig.model_fields[section].default) if section else TailspecConfig
    lo, hi = -math.inf, math.inf
    for m in model.model_fields[name].metadata:
        if isinstance(m, at.Ge):
            lo = m.ge
        elif isinstance(m, at.Gt):
            lo = m.gt
        elif isinstance(m, at.Le):
            hi = m.le
        elif isinstance(m, at.Lt):
            hi = m.lt
    return lo, hi


def _check_whole(cfg: TailspecConfig) -> None:
    for section, name in FIELDS:
        v = getattr(getattr(cfg, section), name) if section else getattr(cfg, name)
        if isinstance(v, float):
            assert math.isfinite(v), (section, name, v)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            lo, hi = _bounds(section, name)
            assert lo <= v <= hi, (section, name, v)
        if isinstance(v, str):
            assert "\x00" not in v, (section, name)
    text = dump_config(cfg)
    assert TailspecConfig.model_validate(yaml.safe_load(text)) == cfg


def test_config_values_fuzzed(tmp_path):
    tally = Tally("config")

    @settings(FUZZ, max_examples=CASES)
    @given(st.data())
    def case(data):
        section, name = data.draw(st.sampled_from(FIELDS), label="field")
        unknown = data.draw(st.sampled_from([False, False, False, True]), label="unknown key")
        if unknown:
            name = data.draw(st.sampled_from([name + "_x", "nope", "_", name[:-1] or "y"]), label="key")
        path = f"{section}.{name}" if section else name
        raw = data.draw(RAW, label="value")
        source = data.draw(st.sampled_from(["set", "env", "file"]), label="source")
        environ: dict[str, str] = {}
        overrides: list[str] = []
        file = None
        if source == "set":
            overrides = [f"{path}={raw}"]
        elif source == "env":
            if "\x00" in raw or not name.isidentifier():
                return
            environ = {"TAILSPEC_" + path.upper().replace(".", "__"): raw}
        else:
            file = tmp_path / "c.yaml"
            try:
                value = yaml.safe_load(raw)
            except (yaml.YAMLError, ValueError):
                value = raw
            tree = {section: {name: value}} if section else {name: value}
            try:
                file.write_text(yaml.safe_dump(tree))
            except (yaml.YAMLError, UnicodeEncodeError, ValueError):
                return
        try:
            cfg = load_config(file, overrides, environ=environ)
        except ConfigError as e:
            msg = str(e)
            assert path in msg or (section and f"{section}:" in msg), f"{path} not named: {msg[:500]}"
            assert len(msg) < 3000
            tally.add("refused")
        else:
            assert not unknown, f"unknown key {path} accepted"
            _check_whole(cfg)
            tally.add("accepted")
        tally.add("cases")

    case()
    tally.report("cases")
    assert tally.counts.get("refused", 0) > CASES // 4 and tally.counts.get("accepted", 0) > 10, tally.counts


def test_config_rejects_named():
    """What the fuzzing found, pinned: each refused with its key named."""
    for item, needle in [
        ("trainer.weight_decay=.inf", "trainer.weight_decay"),
        ("trainer.grad_clip=nan", "trainer.grad_clip"),
        ("scheduler.idle_window_s=1e400", "scheduler.idle_window_s"),
        ("trainer.seed=-1", "trainer.seed"),
        ("trainer.seed=99999999999999999999999", "trainer.seed"),
        ("trainer.max_seq_len=" + "1" * 5000, "trainer.max_seq_len"),
        ("cluster.redis_url=http://h", "cluster.redis_url"),
        ("cluster.redis_url=redis://h:99999", "cluster.redis_url"),
        ("task.steps_min=40", None),
        ("trainer.checkpoint_dir=", "trainer.checkpoint_dir"),
        ("dashboards.host=a b", "dashboards.host"),
    ]:
        overrides = [item, "task.steps_max=30"] if needle is None else [item]
        try:
            load_config(None, overrides, environ={})
        except ConfigError as e:
            assert (needle or "steps_min") in str(e), (item, str(e))
        else:
            raise AssertionError(f"{item} accepted")
    cfg = load_config(None, ["trainer.checkpoint_dir=2024", "cluster.redis_url=rediss://:pw@h:6380/0?ssl_ca_certs=/c.pem"],
                      environ={})
    assert cfg.trainer.checkpoint_dir == "2024" and cfg.cluster.redis_url.startswith("rediss://")
