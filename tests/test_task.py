import json

import numpy as np
import pytest
import torch

from tailspec.config import TaskConfig
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
