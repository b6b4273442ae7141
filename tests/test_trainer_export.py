"""Export: EAGLE-3 / HF directories with exactly the listed keys, dtypes and shapes; bitwise round trip;
refusals; the directory is whole or absent."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tailspec.drafter_trainer.export import ExportError, export, load_export
from tailspec.drafter_trainer.model import Eagle3Config, Eagle3Module, vocab_maps_from_counts

from tests.test_trainer_model import make_drafter, make_target

torch.set_num_threads(1)
H, V = 32, 21


def expected_shapes(draft_vocab: int, inter: int = 64, heads: int = 4, kv: int = 2, hd: int = 8) -> dict:
    return {
        "fc.weight": (H, 3 * H),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, heads * hd),
        "midlayer.mlp.gate_proj.weight": (inter, H),
        "midlayer.mlp.up_proj.weight": (inter, H),
        "midlayer.mlp.down_proj.weight": (H, inter),
        "norm.weight": (H,),
        "lm_head.weight": (draft_vocab, H),
    }


def read(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture
def target():
    return make_target(layers=4)


def small_vocab_drafter(target):
    d = make_drafter(target, 16)
    d.set_vocab_maps(*vocab_maps_from_counts(torch.arange(V).float(), 16))
    return d


def test_eagle3_directory_exactly(tmp_path, target):
    d = small_vocab_drafter(target)
    out = export(d, tmp_path / "e3", "eagle3")
    t = read(out)
    shapes = expected_shapes(16)
    assert set(t) == set(shapes) | {"d2t", "t2d"}
    for k, s in shapes.items():
        assert tuple(t[k].shape) == s and t[k].dtype == torch.float32, k
    assert t["d2t"].dtype == torch.int64 and tuple(t["d2t"].shape) == (16,)
    assert t["t2d"].dtype == torch.bool and tuple(t["t2d"].shape) == (V,)
    assert ((torch.arange(16) + t["d2t"]) == torch.arange(5, 21)).all()  # the 16 most frequent ids
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 16 and cfg["vocab_size"] == V and cfg["target_hidden_size"] == H
    assert cfg["num_hidden_layers"] == 1 and cfg["hidden_size"] == H and cfg["head_dim"] == 8
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    tc = target.config
    assert cfg["rope_theta"] == tc.rope_parameters["rope_theta"]
    assert cfg["max_position_embeddings"] == tc.max_position_embeddings
    assert cfg["rms_norm_eps"] == tc.rms_norm_eps
    assert cfg["num_key_value_heads"] == tc.num_key_value_heads
    assert "embed_tokens.weight" not in t


def test_full_vocab_ships_no_d2t(tmp_path, target):
    d = make_drafter(target, None)
    t = read(export(d, tmp_path / "e3", "eagle3"))
    assert set(t) == set(expected_shapes(V))  # vLLM refuses d2t when the vocabularies match
    assert "lm_head.weight" in t  # always shipped


def test_hf_directory_carries_the_embedding(tmp_path, target):
    d = small_vocab_drafter(target)
    t = read(export(d, tmp_path / "hf", "hf"))
    assert set(t) == set(expected_shapes(16)) | {"d2t", "t2d", "embed_tokens.weight"}
    assert torch.equal(t["embed_tokens.weight"], target.get_input_embeddings().weight)


@pytest.mark.parametrize("fmt", ["eagle3", "hf"])
def test_round_trip_is_bitwise(tmp_path, target, fmt):
    d = small_vocab_drafter(target)
    e = load_export(export(d, tmp_path / fmt, fmt), target.get_input_embeddings())
    for k, v in d.state_dict().items():
        assert torch.equal(v, e.state_dict()[k]), k
    hidden, ids, pos = torch.randn(2, 6, H), torch.randint(0, V, (2, 6)), torch.arange(6).expand(2, 6)
    assert torch.equal(d(hidden, ids, pos)[0], e(hidden, ids, pos)[0])


def test_bf16_export(tmp_path, target):
    t = read(export(small_vocab_drafter(target), tmp_path / "b", "eagle3", dtype="bfloat16"))
    assert t["fc.weight"].dtype == torch.bfloat16 and t["d2t"].dtype == torch.int64


def test_refusals(tmp_path, target):
    small = make_target(layers=2)
    d = Eagle3Module(Eagle3Config.from_target(small.config), small.get_input_embeddings())  # ids (0, 1, 2)
    with pytest.raises(ExportError, match=r"outside 1\.\.1"):
        export(d, tmp_path / "x", "eagle3")
    assert not (tmp_path / "x").exists()
    export(d, tmp_path / "x", "hf")  # our own format accepts ids 0..n
    d = make_drafter(target)
    d.config.aux_layer_ids = (1, 1, 2)
    with pytest.raises(ExportError, match="collide"):
        export(d, tmp_path / "y", "eagle3")
    with pytest.raises(ExportError, match="format"):
        export(make_drafter(target), tmp_path / "z", "onnx")  # type: ignore[arg-type]
    assert not (tmp_path / "y").exists() and not (tmp_path / "z").exists()


def test_failed_write_leaves_previous_export_whole(tmp_path, target, monkeypatch):
    d = small_vocab_drafter(target)
    out = export(d, tmp_path / "e3", "eagle3")
    before = read(out)
    import tailspec.drafter_trainer.export as ex

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ex, "save_file", boom)
    with pytest.raises(OSError):
        export(make_drafter(target, 16, seed=9), tmp_path / "e3", "eagle3")
    after = read(out)
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert [p.name for p in tmp_path.iterdir()] == ["e3"]
