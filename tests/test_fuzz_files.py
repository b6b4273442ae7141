"""Bad input, fuzzed: truncated and tampered files in checkpoint, lineage, version and export directories.

Each case copies a known-good tree, damages one file (truncate at a random offset, flip a byte, delete it; for
safetensors: a wrong dtype / shape / offsets / names in the header, NaN written into the data, with or without the
recorded CRC-32 re-stamped so the structural checks are reached too; for JSON: not an object, invalid UTF-8, a
field given a wrong type, NaN, 1e400 or a huge integer, a field deleted), then loads. The verdict:
- the loader refuses with its own error (DrafterFileError / ValueError, LineageError, FileNotFoundError) whose
  message names the damaged directory or file, and nothing else is raised; or it loads exactly the original;
- the previous good one is kept and used: load_latest falls back to the previous checkpoint, a lineage pull to
  the head the damaged one replaced (and the next merge lands on it), the version store's current drafter to
  the earlier promoted version; a damaged record (HEAD, CURRENT, contributions) is refused and never
  overwritten.

Case counts: printed, and written to test-output/fuzz-cases.json.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import time
from pathlib import Path

import pytest
import torch
from fuzz_helpers import FUZZ, Tally
from hypothesis import given, settings
from hypothesis import strategies as st
from tailspec.core.state import DrafterVersion
from tailspec.drafter_trainer.checkpoint import load_checkpoint, load_latest, save_checkpoint
from tailspec.drafter_trainer.export import export, load_export
from tailspec.drafter_trainer.files import DrafterFileError, file_crc32
from tailspec.drafter_trainer.lineage import Lineage, LineageError, _read_weights, snapshot
from tailspec.drafter_trainer.model import CONFIG_NAME, WEIGHTS_NAME, Eagle3Config, Eagle3Module
from tailspec.drafter_trainer.versions import VersionStore

CASES = 60  # per loader (hypothesis max_examples)
REFUSED = (DrafterFileError, ValueError, FileNotFoundError, LineageError)


def tiny_drafter(seed: int, vocab: int = 32, draft: int = 32) -> Eagle3Module:
    cfg = Eagle3Config(target_hidden_size=16, hidden_size=16, vocab_size=vocab, draft_vocab_size=draft,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32,
                       rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64, aux_layer_ids=(1, 2, 3),
                       target_num_layers=4)
    torch.manual_seed(seed)
    d = Eagle3Module(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape))
    return d


def optimizer_state(d: Eagle3Module) -> dict:
    d = copy.deepcopy(d)  # the moments of one step; the drafter itself unchanged
    params = [p for p in d.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    loss = sum((p * p).sum() for p in params)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt.state_dict()


def same_weights(a: Eagle3Module, b: Eagle3Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# -- damage -----------------------------------------------------------------------------------------------
JUNK = st.sampled_from(["x", "", [], {}, None, -1, 10**30, 1e300, True, 2.5, "__NAN__", "__BIG__", [1, "a"]])
NOT_OBJECT = st.sampled_from(["[]", "3", '"text"', "null", "[1, 2]", "true", ""])
DTYPES = st.sampled_from(["F16", "BF16", "I32", "F64", "BOOL", "U8", "I64", "X9"])


def _dump(obj) -> str:
    return json.dumps(obj).replace('"__NAN__"', "NaN").replace('"__BIG__"', "1e400")


def _paths(obj, prefix=()):
    """Key paths into a JSON object, one level of nesting."""
    for k, v in obj.items():
        yield prefix + (k,)
        if isinstance(v, dict) and not prefix:
            yield from _paths(v, (k,))


def restamp(f: Path) -> None:
    """Record the damaged safetensors file's CRC-32 where the format keeps it (as a buggy writer would)."""
    crc = file_crc32(f)
    d = f.parent
    if f.name == "optimizer.safetensors":
        ts = json.loads((d / "trainer_state.json").read_text())
        ts["optimizer"]["crc32"] = crc
        (d / "trainer_state.json").write_text(json.dumps(ts))
    elif (d / CONFIG_NAME).is_file():
        meta = json.loads((d / CONFIG_NAME).read_text())
        meta["weights_crc32"] = crc
        (d / CONFIG_NAME).write_text(json.dumps(meta))
    elif (d / "config.json").is_file():
        meta = json.loads((d / "config.json").read_text())
        meta["tailspec"]["weights_crc32"] = crc
        (d / "config.json").write_text(json.dumps(meta))


def _header(f: Path) -> tuple[dict, bytes]:
    b = f.read_bytes()
    n = int.from_bytes(b[:8], "little")
    return json.loads(b[8:8 + n]), b[8 + n:]


def _write_header(f: Path, hdr: dict, data: bytes) -> None:
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    f.write_bytes(len(h).to_bytes(8, "little") + h + data)


def damage(data, f: Path) -> str:
    """Damage file `f` in one drawn way; → a label of what was done."""
    size = f.stat().st_size
    kinds = ["truncate", "flip", "delete"]
    if f.suffix == ".safetensors":
        kinds += ["dtype", "shape", "offsets", "names", "nan"]
    elif f.suffix in (".json", "") and f.name not in ("LATEST",):
        kinds += ["not_object", "bad_utf8", "field", "drop_field"]
    kind = data.draw(st.sampled_from(kinds), label=f"damage {f.name}")
    if kind == "truncate":
        with open(f, "r+b") as h:
            h.truncate(data.draw(st.integers(0, max(size - 1, 0)), label="at"))
    elif kind == "flip":
        b = bytearray(f.read_bytes())
        if not b:
            b = bytearray(b"\x00")
        i = data.draw(st.integers(0, len(b) - 1), label="offset")
        b[i] ^= data.draw(st.integers(1, 255), label="xor")
        f.write_bytes(bytes(b))
    elif kind == "delete":
        f.unlink()
    elif kind in ("dtype", "shape", "offsets", "names", "nan"):
        hdr, payload = _header(f)
        names = sorted(k for k in hdr if k != "__metadata__")
        name = data.draw(st.sampled_from(names), label="tensor")
        if kind == "dtype":
            hdr[name]["dtype"] = data.draw(DTYPES.filter(lambda t: t != hdr[name]["dtype"]), label="dtype")
        elif kind == "shape":
            shape = hdr[name]["shape"]
            hdr[name]["shape"] = data.draw(st.sampled_from([shape[::-1] + [1], shape + [1], [], [0],
                                                            [s * 2 for s in shape] or [2], [-1] + shape[1:]]))
        elif kind == "offsets":
            a, b = hdr[name]["data_offsets"]
            hdr[name]["data_offsets"] = data.draw(st.sampled_from([[a, b + 4], [a + 4, b], [b, a], [a, 10**15]]))
        elif kind == "names":
            if data.draw(st.booleans(), label="drop"):
                del hdr[name]
            else:
                hdr[name + ".extra"] = hdr.pop(name)
        else:  # a NaN written into a float tensor's bytes
            floats = [k for k in names if hdr[k]["dtype"] == "F32" and hdr[k]["shape"]]
            if floats:
                a, _ = hdr[data.draw(st.sampled_from(floats), label="nan tensor")]["data_offsets"]
                p = bytearray(payload)
                p[a:a + 4] = b"\x00\x00\xc0\x7f"
                payload = bytes(p)
        _write_header(f, hdr, payload)
        if data.draw(st.booleans(), label="restamp crc"):
            restamp(f)
            kind += "+crc"
    elif kind == "not_object":
        f.write_text(data.draw(NOT_OBJECT, label="text"))
    elif kind == "bad_utf8":
        f.write_bytes(b"{\"a\": \"\xff\xfe\"}")
    else:
        obj = json.loads(f.read_text())
        path = data.draw(st.sampled_from(sorted(_paths(obj), key=str)), label="field")
        node = obj
        for k in path[:-1]:
            node = node[k]
        if kind == "field":
            node[path[-1]] = data.draw(JUNK, label="value")
        else:
            del node[path[-1]]
        f.write_text(_dump(obj))
        kind += ":" + ".".join(path)
    return kind


def refused(e: BaseException, *where: Path) -> None:
    """A refusal of the loader's own type naming one of `where` (the damaged file, or the directory holding it)."""
    if isinstance(e, AssertionError):
        raise e
    assert isinstance(e, REFUSED), f"{type(e).__name__} is not a refusal: {e}"
    assert any(str(w) in str(e) for w in where), f"error does not name {[str(w) for w in where]}: {e}"
    assert len(str(e)) < 5000


# -- the good trees (built once, copied per case) ---------------------------------------------------------
@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    d1, d2 = tiny_drafter(1), tiny_drafter(2)
    # checkpoints: ckpt-1 (the previous good one) and ckpt-2 (LATEST, damaged in the cases)
    save_checkpoint(root / "ck", d1, optimizer_state(d1), {"step": 1, "tokens": 10, "backend": "torch"})
    save_checkpoint(root / "ck", d2, optimizer_state(d2), {"step": 2, "tokens": 20, "backend": "torch"})
    # lineage without Redis: head 1 (seed) and head 2 (one merge); head 1 is kept as the one head 2 replaced
    lin = Lineage(root / "lin")
    lin.seed(d1, {"step": 0, "tokens": 0, "backend": "torch"})
    base, _ = lin.pull()
    res = lin.merge(base, snapshot(d1), d2, optimizer_state(d2), {"step": 3, "backend": "torch"}, "s", 1, 3)
    assert res.merged and res.head.number == 2
    # versions without Redis: v1 promoted, then v2 promoted (current)
    store = VersionStore(root / "ver")
    for n, d in ((1, d1), (2, d2)):
        info = DrafterVersion(version=n, path=str(store.path(n).resolve()), policy_version=n, promoted=True,
                              created_at=time.time(), acceptance_length=1.5)
        d.save(store.path(n), extra={"version": info.model_dump(mode="json")})
        (store.path(n) / "version.json").write_text(info.model_dump_json())
        store.seed(info)
    # an export with a reduced draft vocabulary (d2t/t2d shipped) in the hf format (embedding shipped)
    d3 = tiny_drafter(3, vocab=32, draft=24)
    d3.set_target_embedding(torch.nn.Embedding(32, 16))
    export(d3, root / "ex", fmt="hf")
    return root, {"d1": d1, "d2": d2, "d3": load_export(root / "ex")}


def fresh(good_root: Path, tmp_path: Path, name: str) -> Path:
    dst = tmp_path / f"case-{time.monotonic_ns()}"
    shutil.copytree(good_root / name, dst / name)
    # records name directories by absolute path: point the copy's at the copy
    for f in (dst / name).rglob("*"):
        if f.is_file() and f.suffix in (".json", ".jsonl", "") and f.name != "LATEST":
            text = f.read_text()
            if str(good_root) in text:
                f.write_text(text.replace(str(good_root / name), str(dst / name)))
    return dst / name


def _files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and not p.name.startswith("."))


# -- checkpoints ------------------------------------------------------------------------------------------
def test_checkpoints_damaged(good, tmp_path):
    root, ref = good
    targets = [f for f in _files(root / "ck") if f.startswith("ckpt-00000002/") or f == "LATEST"]
    tally = Tally("files_checkpoint")

    @settings(FUZZ, max_examples=CASES)
    @given(st.data())
    def case(data):
        ck = fresh(root, tmp_path, "ck")
        target = ck / data.draw(st.sampled_from(targets), label="file")
        kind = damage(data, target)
        try:
            direct = load_checkpoint(ck / "ckpt-00000002")
        except BaseException as e:  # noqa: BLE001 - judged
            refused(e, ck / "ckpt-00000002")
            direct = None
        if direct is not None:  # accepted: exactly what was written
            assert direct.step == 2 and same_weights(direct.drafter, ref["d2"]), kind
        latest = load_latest(ck)  # never raises here: ckpt-1 is whole
        if direct is not None:
            assert latest.step == 2 and same_weights(latest.drafter, ref["d2"]), kind
            tally.add("accepted" if target.name != "LATEST" else "pointer damaged, newest used")
        else:
            assert latest.step == 1 and same_weights(latest.drafter, ref["d1"]), kind
            assert latest.optimizer_state is not None and latest.trainer_state["tokens"] == 10
            tally.add("refused, previous used")
        tally.add("cases")

    case()
    tally.report("cases")


def test_no_checkpoint_loads(good, tmp_path):
    """Both damaged: one error naming each directory, nothing else."""
    root, _ = good
    ck = fresh(root, tmp_path, "ck")
    for name in ("ckpt-00000001", "ckpt-00000002"):
        with open(ck / name / WEIGHTS_NAME, "r+b") as f:
            f.truncate(100)
    with pytest.raises(DrafterFileError) as e:
        load_latest(ck)
    assert "ckpt-00000001" in str(e.value) and "ckpt-00000002" in str(e.value) and str(ck) in str(e.value)


# -- lineage ----------------------------------------------------------------------------------------------
def test_lineage_damaged(good, tmp_path):
    root, ref = good
    head_dir = next(p for p in (root / "lin").iterdir() if p.name.startswith("head-00000002-"))
    targets = ["HEAD", "contributions.json"] + [f"{head_dir.name}/{f}" for f in _files(head_dir)]
    tally = Tally("files_lineage")

    @settings(FUZZ, max_examples=CASES)
    @given(st.data())
    def case(data):
        lin_root = fresh(root, tmp_path, "lin")
        rel = data.draw(st.sampled_from(targets), label="file")
        target = lin_root / rel
        kind = damage(data, target)
        before = {p: p.read_bytes() for p in (lin_root / "HEAD", lin_root / "contributions.json") if p.is_file()}
        lin = Lineage(lin_root)
        try:
            head, ck = lin.pull()
        except BaseException as e:  # noqa: BLE001 - judged
            refused(e, target, lin_root)
            assert rel in ("HEAD", "contributions.json") or rel.startswith(head_dir.name), kind
            # a damaged record is refused by a merge too, and never overwritten
            with pytest.raises(LineageError):
                lin.merge(None, snapshot(ref["d1"]), ref["d1"], None, {}, "t", 1, 1)
            assert {p: p.read_bytes() for p in before} == before
            tally.add("record refused, kept")
            tally.add("cases")
            return
        if same_weights(ck.drafter, ref["d2"]):  # (a flipped digit in HEAD's number is a valid record)
            tally.add("accepted")
        else:  # the head's directory is damaged: the head it replaced is used
            assert head.number == 1 and same_weights(ck.drafter, ref["d1"]), kind
            with pytest.raises(REFUSED):  # the head's record names a directory that does not load
                load_checkpoint(lin.head().path)
            tally.add("head refused, previous used")
        # the lineage goes on: a merge on what was pulled lands, and the new head loads whole
        if rel == "contributions.json":
            try:
                lin.contributions()
            except LineageError as e:
                refused(e, target)
                tally.add("cases")
                return
        d = ck.drafter
        base = snapshot(d)
        with torch.no_grad():
            next(d.parameters()).add_(1.0)
        res = lin.merge(head, base, d, None, {"step": 9}, "u", 1, 1)
        assert res.merged and res.head.number == lin.head().number, kind
        # the delta lands on the newest head whose weights are whole: head 2's (its weights may be intact when
        # another of its files is not), else head 1's = the base (the new head is then the local weights)
        try:
            src = _read_weights(lin_root / head_dir.name)
        except (DrafterFileError, OSError):
            src = None
        expect = {k: v.clone() for k, v in d.state_dict().items()}
        if head.number == 1 and src is not None:
            for n, p in d.named_parameters():
                expect[n] = src[n] + 1.0 * (p.detach() - base[n])
        got = load_checkpoint(res.head.path).drafter.state_dict()
        assert all(torch.equal(got[k], expect[k]) for k in expect), kind
        tally.add("cases")

    case()
    tally.report("cases")


# -- versions ---------------------------------------------------------------------------------------------
def test_versions_damaged(good, tmp_path):
    root, ref = good
    targets = ["CURRENT", "history.jsonl"] + [f"v00002/{f}" for f in _files(root / "ver" / "v00002")]
    tally = Tally("files_versions")

    @settings(FUZZ, max_examples=CASES)
    @given(st.data())
    def case(data):
        ver = fresh(root, tmp_path, "ver")
        rel = data.draw(st.sampled_from(targets), label="file")
        target = ver / rel
        kind = damage(data, target)
        store = VersionStore(ver)
        store.history()  # a damaged history line is skipped, never a crash
        try:
            direct = store.get(2)
            direct_ok = same_weights(Eagle3Module.load(direct.path), ref["d2"])
        except BaseException as e:  # noqa: BLE001 - judged
            # (a flipped character in the record's path: the error names that path, still .../v00002)
            refused(e, ver / "v00002", target, ver, Path("v00002"))
            direct_ok = False
        try:
            drafter, info = store.load()
        except BaseException as e:  # noqa: BLE001 - judged
            refused(e, target, ver)
            assert rel == "CURRENT", kind  # only a damaged (or deleted) pointer leaves no current version
            tally.add("pointer refused")
            tally.add("cases")
            return
        if info.version == 2:
            assert same_weights(drafter, ref["d2"]), kind
            tally.add("accepted")
        else:  # v2 is damaged: never loaded; the earlier promoted version is
            assert info.version == 1 and same_weights(drafter, ref["d1"]), kind
            assert not direct_ok or rel == "CURRENT" or rel.endswith("version.json"), kind  # (a record's path)
            tally.add("refused, previous used")
        tally.add("cases")

    case()
    tally.report("cases")


# -- exports ----------------------------------------------------------------------------------------------
def test_exports_damaged(good, tmp_path):
    root, ref = good
    targets = _files(root / "ex")
    tally = Tally("files_export")

    @settings(FUZZ, max_examples=CASES)
    @given(st.data())
    def case(data):
        ex = fresh(root, tmp_path, "ex")
        target = ex / data.draw(st.sampled_from(targets), label="file")
        kind = damage(data, target)
        try:
            d = load_export(ex)
        except BaseException as e:  # noqa: BLE001 - judged
            refused(e, ex)
            tally.add("refused")
        else:
            assert same_weights(d, ref["d3"]), kind
            tally.add("accepted")
        tally.add("cases")

    case()
    tally.report("cases")


def test_huge_config_is_refused_before_allocating(good, tmp_path):
    """A config claiming a huge model (in range) whose file does not hold it: refused from the header, no
    allocation of the claimed size."""
    root, _ = good
    ck = fresh(root, tmp_path, "ck")
    f = ck / "ckpt-00000002" / CONFIG_NAME
    meta = json.loads(f.read_text())
    meta["config"].update(hidden_size=1 << 17, intermediate_size=1 << 19)
    f.write_text(json.dumps(meta))
    t = time.monotonic()
    with pytest.raises(DrafterFileError, match="shape"):
        load_checkpoint(ck / "ckpt-00000002")
    assert time.monotonic() - t < 5
    assert math.isfinite(load_latest(ck).step)


def test_a_current_pointer_naming_another_version_is_refused(good, tmp_path):
    """The case a fuzz run found: CURRENT well-formed, its `version` changed (10**30), its path still v00002. It
    names another version than the record in that directory, so it is refused as damaged rather than handed
    out as version 10**30 with v2's weights."""
    root, _ = good
    ver = fresh(root, tmp_path, "ver")
    rec = json.loads((ver / "CURRENT").read_text())
    rec["version"] = 10**30
    (ver / "CURRENT").write_text(json.dumps(rec))
    with pytest.raises(DrafterFileError, match="CURRENT: records version 1000000000000000000000000000000"):
        VersionStore(ver).load()


def test_an_export_whose_torch_dtype_is_not_a_dtype_name_is_refused(good, tmp_path):
    """The case a fuzz run found: config.json's torch_dtype replaced by a list crashed the loader with a TypeError
    (unhashable) instead of a refusal naming the file."""
    root, _ = good
    ex = fresh(root, tmp_path, "ex")
    cfg = json.loads((ex / "config.json").read_text())
    for bad in ([], "float8"):
        cfg["torch_dtype"] = bad
        (ex / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(DrafterFileError, match="config.json: torch_dtype"):
            load_export(ex)


def test_a_versions_own_record_damaged_is_judged_by_its_directory(good, tmp_path):
    """Two damages the fuzzing above once found, kept as fixed cases. A flipped digit in v00002/version.json's
    `version` (2 -> 3) is that record's damage, not CURRENT's (CURRENT's 2 agrees with the directory's name): the
    current version still loads. An altered `path` in it is refused by `get`, naming the record, instead of
    sending a load to another directory."""
    root, ref = good
    ver = fresh(root, tmp_path, "ver")
    rec = ver / "v00002" / "version.json"
    original = rec.read_text()
    rec.write_text(original.replace('"version":2', '"version":3', 1))
    drafter, info = VersionStore(ver).load()
    assert info.version == 2 and same_weights(drafter, ref["d2"])
    rec.write_text(original.replace(json.loads(original)["path"], "x", 1))
    with pytest.raises(DrafterFileError, match="version.json: records path x"):
        VersionStore(ver).get(2)
    drafter, info = VersionStore(ver).load()  # CURRENT's own path is intact: the current version loads
    assert info.version == 2 and same_weights(drafter, ref["d2"])
