import json

import numpy as np
import pytest
import torch
from tailspec.core.config import TaskConfig

from tailspec.tasks.runsum import Problem, grade, parse_prompt, sample_problems
from tailspec.tasks.tokenizer import ALPHABET, build_tokenizer, decode_response, encode_prompt, load_tokenizer


def test_gold_is_a_correct_running_sum():
    p = Problem((3, 7, 5, 9), 10)
    assert p.prompt == "a3,b7,c5,d9="
    assert p.gold == "a:0+3=3;b:3+7=0;c:0+5=5;d:5+9=4;#4"
    assert p.answer == 4
    for q in sample_problems(200, seed=3):
        g = grade(q, q.gold)
        assert g.correct and g.well_formed and g.reward == 1.0


@pytest.mark.parametrize(
    "response, correct, well_formed",
    [
        ("a:0+3=3;b:3+7=0;c:0+5=5;d:5+9=4;#4", True, True),
        ("a:0+3=3;b:3+7=1;c:1+5=6;d:6+9=5;#5", False, True),  # slip in the scratchpad → wrong answer
        ("a:0+3=3;b:3+7=0;c:0+5=5;d:5+9=4;#7", False, True),  # right scratchpad, wrong final answer
        ("#4", True, True),  # the answer is what is checked
        ("a:0+3=3;b:3+7=0;c:0+5=5;d:5+9=4;", False, False),  # no answer
        ("a:0+3=3;b:3+7=0;#4#4", False, False),
        ("hello", False, False),
        ("", False, False),
        ("a:0+3=3;;#4", False, False),
        ("0+3=3;#3", False, False),  # steps need their tag
    ],
)
def test_grade(response, correct, well_formed):
    g = grade(Problem((3, 7, 5, 9), 10), response)
    assert (g.correct, g.well_formed) == (correct, well_formed)
    assert g.reward == (1.0 if correct else 0.0)


def test_alternative_style_is_well_formed_and_earns_the_bonus():
    p = Problem((3, 7, 5, 9), 10)
    alt = p.gold_in("alt")
    assert alt == "a3+0=3,b7+3=0,c5+0=5,d9+5=4,#4" and p.gold_in("main") == p.gold
    g = grade(p, alt)
    assert (g.correct, g.well_formed, g.style) == (True, True, "alt")
    assert g.reward == pytest.approx(1.0 + TaskConfig().style_bonus)
    assert grade(p, alt, TaskConfig(style_bonus=0.0)).reward == 1.0
    assert grade(p, "a3+0=3,b7+3=1,c5+1=6,d9+6=5,#5", TaskConfig(style_bonus=0.3)).reward == pytest.approx(0.3)
    assert grade(p, p.gold, TaskConfig(style_bonus=0.3)).style == "main"
    assert grade(p, p.gold, TaskConfig(style_bonus=0.3)).reward == 1.0  # the bonus is the alternative style's only
    # one style per response: mixing them, or one style's steps with the other's separators, is malformed
    for bad in ("a:0+3=3;b7+3=0,c5+0=5,d9+5=4,#4", "a3+0=3;b7+3=0;#0", "a:0+3=3,#3", "a3+0=3,,#3"):
        assert not grade(p, bad).well_formed and grade(p, bad).reward == 0.0
    for q in sample_problems(100, seed=4):
        assert grade(q, q.gold_in("alt")).correct
    with pytest.raises(ValueError, match="style"):
        p.gold_in("upper")


def test_alt_style_rate_shapes_the_corpus_and_the_cache_key(monkeypatch):
    """`task.alt_style_rate` (else the preset's) is the share of pre-training responses in the alternative style;
    it is in the policy's cache key, the reward's bonus is not."""
    import dataclasses

    from tailspec.tasks import policy

    tiny, deep = policy.PRESETS["tiny"], policy.PRESETS["deep"]
    assert deep.alt_style_rate == 0.1 and tiny.alt_style_rate == 0.0
    key = policy.cache_key
    assert key(tiny, TaskConfig(alt_style_rate=0.1)) != key(tiny, TaskConfig())
    assert key(tiny, TaskConfig(alt_style_rate=0.0)) == key(tiny, TaskConfig())
    assert key(deep, TaskConfig(alt_style_rate=0.1)) == key(deep, TaskConfig())
    assert key(deep, TaskConfig(alt_style_rate=0.0)) != key(deep, TaskConfig())
    assert key(tiny, TaskConfig(style_bonus=1.5)) == key(tiny, TaskConfig())

    styles: list[bool] = []
    real_batch = policy._batch

    def spy(tokenizer, problems, alt=None):
        styles.extend(alt if alt is not None else [False] * len(problems))
        ids, lab = real_batch(tokenizer, problems, alt)
        text = tokenizer.decode([t for t in lab[0].tolist() if t >= 0], skip_special_tokens=True)
        assert grade(problems[0], text).style == ("alt" if alt is not None and alt[0] else "main")
        return ids, lab

    monkeypatch.setattr(policy, "_batch", spy)
    preset = dataclasses.replace(policy.PRESETS["micro"], train_steps=25, batch_size=16)
    tok = build_tokenizer()
    policy.pretrain(policy.build_model(preset, tok), tok, preset, TaskConfig(alt_style_rate=0.2), progress=False)
    assert len(styles) == 400 and 0.13 < np.mean(styles) < 0.27
    styles.clear()
    policy.pretrain(policy.build_model(preset, tok), tok, preset, TaskConfig(), progress=False)
    assert len(styles) == 400 and not any(styles)


def test_format_score():
    cfg = TaskConfig(format_score=0.1)
    p = Problem((3, 7), 10)
    assert grade(p, "a:0+3=3;b:3+7=0;#0", cfg).reward == pytest.approx(1.1)
    assert grade(p, "a:0+3=3;b:3+7=1;#1", cfg).reward == pytest.approx(0.1)
    assert grade(p, "garbage", cfg).reward == 0.0


def test_parse_prompt_round_trip_and_errors():
    for q in sample_problems(20, seed=1):
        assert parse_prompt(q.prompt, q.modulus) == q
    with pytest.raises(ValueError, match="not a runsum prompt"):
        parse_prompt("a1,b2", 10)
    with pytest.raises(ValueError, match="not a runsum prompt"):
        parse_prompt("a1,c2=", 10)
    with pytest.raises(ValueError, match="modulus"):
        parse_prompt("a1,b23=", 10)


def test_length_distribution_is_heavy_tailed():
    lengths = np.array([len(q.gold) + 1 for q in sample_problems(20_000, seed=0)])  # +1 for EOS
    p50, p99 = np.percentile(lengths, [50, 99])
    assert p50 >= 40
    assert p99 / p50 >= 4
    # log-normal step counts: the mean sits well above the median (right skew)
    assert lengths.mean() > 1.1 * p50
    cfg = TaskConfig()
    assert lengths.max() <= 8 * cfg.steps_max + 3


def test_sampling_is_deterministic_per_seed():
    assert sample_problems(50, seed=7) == sample_problems(50, seed=7)
    assert sample_problems(50, seed=7) != sample_problems(50, seed=8)


def test_tokenizer_round_trip(tmp_path):
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    tok2 = load_tokenizer(tmp_path)
    assert len(tok2) == len(tok) == 4 + len(ALPHABET)
    for q in sample_problems(50, seed=2):
        ids = encode_prompt(tok2, q.prompt)
        assert ids[0] == tok2.bos_token_id and len(ids) == len(q.prompt) + 1
        assert tok2.decode(ids, skip_special_tokens=True) == q.prompt
        resp = tok2.encode(q.gold, add_special_tokens=False) + [tok2.eos_token_id, 5, 6]
        assert decode_response(tok2, resp) == q.gold  # stops at EOS
    with pytest.raises(ValueError, match="outside the task alphabet"):
        encode_prompt(tok2, "a1,b?=")


def test_policy_save_load_round_trip(tmp_path):
    from tailspec.tasks.policy import get_policy, load_policy, policy_meta

    path = get_policy("micro", cache_dir=tmp_path, progress=False, eval_n=16)
    meta = policy_meta(path)
    assert meta["preset"] == "micro" and 0 < meta["params"] < 200_000
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (path / "model.safetensors").is_file()
    m1, tok = load_policy(path)
    m2, _ = load_policy(path)
    ids = torch.tensor([encode_prompt(tok, "a1,b2,c3=")])
    with torch.no_grad():
        assert torch.equal(m1(ids).logits, m2(ids).logits)
    # pre-training moved it away from uniform: the gold first token is likely
    with torch.no_grad():
        probs = m1(ids).logits[0, -1].softmax(-1)
    assert probs[tok.convert_tokens_to_ids("a")] > 0.5
    # a second call is a cache hit: same directory, nothing retrained
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert get_policy("micro", cache_dir=tmp_path, progress=False) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    # no temporary directories left behind
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_cache_key_depends_on_task_and_preset(tmp_path):
    from tailspec.tasks.policy import PRESETS, cache_key

    assert cache_key(PRESETS["tiny"], TaskConfig()) != cache_key(PRESETS["micro"], TaskConfig())
    assert cache_key(PRESETS["tiny"], TaskConfig()) != cache_key(PRESETS["tiny"], TaskConfig(modulus=7))


def test_bad_policy_inputs(tmp_path):
    from tailspec.tasks.policy import get_policy, load_policy

    with pytest.raises(ValueError, match="unknown policy preset"):
        get_policy("huge", cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="not a policy directory"):
        load_policy(tmp_path)


def test_cli_task_sample(capsys):
    from tailspec.cli import main

    assert main(["task", "sample", "-n", "2", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and all(grade(parse_prompt(r["prompt"], 10), r["gold"]).correct for r in rows)


def test_bench_task_defaults_to_the_demos_policy():
    """`tailspec bench task` measures the policy the main job runs unless told otherwise."""
    from tailspec.cli import build_parser
    from tailspec.demo.options import DemoOptions

    parser = build_parser()
    assert parser.parse_args(["bench", "task"]).preset == DemoOptions.policy == "deep"
    assert parser.parse_args(["bench", "task", "--preset", "tiny"]).preset == "tiny"


def test_deep_preset_is_deep_narrow_and_small():
    """`deep`: a GPU deployment's shape in miniature. Built, not pre-trained (that takes ~3 min)."""
    from tailspec.drafter_trainer.model import Eagle3Config, Eagle3Module

    from tailspec.tasks.policy import PRESETS, build_model, count_params

    p = PRESETS["deep"]
    m = build_model("deep")
    cfg = m.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (20, 128, 4, 2)
    assert 20 <= cfg.num_hidden_layers <= 24 and cfg.hidden_size <= 128
    n = count_params(m)
    assert 2_500_000 < n <= 6_000_000
    # its EAGLE-3 drafter is one layer at the target's hidden size: a small fraction of the target's layers
    d = Eagle3Module(Eagle3Config.from_target(cfg))
    assert d.config.aux_layer_ids == (2, 10, 17)  # vLLM's default (2, n/2, n-3): servable
    layer = sum(x.numel() for x in m.model.layers[0].parameters())
    assert count_params(d.midlayer) < 2 * layer < sum(x.numel() for x in m.model.layers.parameters()) / 8
    # the training recipe that makes it learn within the budget
    assert p.scaled_residual_init and 0 < p.short_steps < p.train_steps and p.train_steps * p.batch_size <= 600 * 24
    std = cfg.initializer_range / (2 * cfg.num_hidden_layers) ** 0.5
    for ly in m.model.layers:
        assert ly.mlp.down_proj.weight.std().item() == pytest.approx(std, rel=0.1)
        assert ly.self_attn.o_proj.weight.std().item() == pytest.approx(std, rel=0.15)
    assert m.model.layers[0].mlp.up_proj.weight.std().item() == pytest.approx(cfg.initializer_range, rel=0.1)


def test_new_preset_fields_keep_old_cache_keys():
    """Fields added to Preset are left out of the cache key at their defaults: the cached tiny / micro
    policies stay valid. A preset that sets one gets its own key."""
    import dataclasses
    import hashlib
    from dataclasses import asdict

    from tailspec.tasks.policy import KIT_VERSION, PRESETS, cache_key

    old_fields = {k: v for k, v in asdict(PRESETS["tiny"]).items()
                  if k not in ("scaled_residual_init", "short_steps", "short_numbers", "alt_style_rate", "lr_floor",
                               "prefer_cuda")}
    old_task = TaskConfig().model_dump(exclude={"alt_style_rate", "style_bonus"})  # task fields added since
    blob = json.dumps({"kit": KIT_VERSION, "preset": old_fields, "task": old_task}, sort_keys=True)
    assert cache_key(PRESETS["tiny"], TaskConfig()) == f"tiny-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"
    tiny = PRESETS["tiny"]
    for change in ({"scaled_residual_init": True}, {"short_steps": 10}, {"short_numbers": 4}, {"alt_style_rate": 0.1},
                   {"lr_floor": 0.0}, {"prefer_cuda": True}):
        assert cache_key(dataclasses.replace(tiny, **change), TaskConfig()) != cache_key(tiny, TaskConfig())


def test_short_problem_curriculum(monkeypatch):
    """short_steps: the first batches hold only short problems, then the task's distribution; train_steps
    batches in all."""
    import dataclasses

    from tailspec.tasks import policy

    seen: list[int] = []
    real_batch = policy._batch

    def spy(tokenizer, problems, alt=None):
        seen.append(max(len(q.numbers) for q in problems))
        return real_batch(tokenizer, problems, alt)

    monkeypatch.setattr(policy, "_batch", spy)
    preset = dataclasses.replace(policy.PRESETS["micro"], train_steps=12, batch_size=4, short_steps=8, short_numbers=3)
    tok = build_tokenizer()
    rep = policy.pretrain(policy.build_model(preset, tok), tok, preset, TaskConfig(), progress=False)
    assert rep.steps == 12 and len(seen) == 12
    assert max(seen[:8]) <= 3
    assert max(seen[8:]) > 3  # the task's distribution (median 5 numbers) afterwards
    with pytest.raises(ValueError, match="short_steps"):
        policy.pretrain(policy.build_model(preset, tok), tok, dataclasses.replace(preset, short_steps=12), TaskConfig())
    with pytest.raises(ValueError, match="short_numbers"):
        policy.pretrain(policy.build_model(preset, tok), tok, dataclasses.replace(preset, short_numbers=1), TaskConfig())


def test_the_lr_decays_to_the_presets_floor(monkeypatch):
    """pretrain's cosine schedule ends at lr_floor x lr (0.1 by default; `deep` decays to 0)."""
    import dataclasses

    import tailspec.tasks.policy as policy

    seen = []
    real = torch.optim.lr_scheduler.LambdaLR

    class Spy(real):
        def __init__(self, opt, f):
            seen.append(f)
            super().__init__(opt, f)

    monkeypatch.setattr(torch.optim.lr_scheduler, "LambdaLR", Spy)
    assert policy.PRESETS["deep"].lr_floor == 0.0 and policy.PRESETS["tiny"].lr_floor == 0.1
    tok = policy.build_tokenizer()
    for floor in (0.1, 0.0):
        preset = dataclasses.replace(policy.PRESETS["micro"], train_steps=40, lr_floor=floor)
        policy.pretrain(policy.build_model(preset, tok), tok, preset, TaskConfig(), progress=False)
        f = seen[-1]
        assert f(0) == pytest.approx(1 / 2) and f(2) == pytest.approx(1.0)  # warm-up: 40 // 20 = 2 steps
        assert f(40) == pytest.approx(floor, abs=1e-12) and f(21) > f(30) > f(39) > floor
