"""Hot reload in ONE live vLLM engine: untrained → trained → untrained drafter weights move vLLM's own
acceptance counters accordingly, the outputs stay token-identical, and the target is untouched."""

from __future__ import annotations

import pytest
from vllm_helpers import MAX_TOKENS, drafters, engine_kwargs, prompts, tiny, token_ids

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine():
    from tailspec.rollout.vllm_backend import DrafterSpec, VllmRollout

    ro = VllmRollout(tiny(), DrafterSpec("eagle3", drafters()["untrained"], k=3), **engine_kwargs())
    yield ro
    ro.close()


def test_reload_untrained_trained_untrained(engine):
    from tailspec.rollout.vllm_backend import greedy

    sp = greedy(MAX_TOKENS, logprobs=0)
    target0, drafter0 = engine.target_digest(), engine.drafter_digest()
    a = engine.generate(prompts(), sp)
    r1 = engine.reload_drafter(drafters()["trained"])
    drafter1 = engine.drafter_digest()
    b = engine.generate(prompts(), sp)
    r2 = engine.reload_drafter(drafters()["untrained"])
    c = engine.generate(prompts(), sp)

    assert token_ids(a) == token_ids(b) == token_ids(c)
    al = [x.counters.acceptance_length for x in (a, b, c)]
    assert al[1] > al[0] + 0.5, f"trained drafter should accept measurably more: {al}"
    # the same weights again → the same acceptance, step for step (greedy, same batch)
    assert (c.counters.drafts, c.counters.accepted_tokens) == (a.counters.drafts, a.counters.accepted_tokens)
    assert c.counters.accepted_per_pos == a.counters.accepted_per_pos

    assert drafter1 != drafter0 and engine.drafter_digest() == drafter0  # the drafter really changed, and back
    assert r1["loaded"] == r2["loaded"] > 0
    # Target untouched: its parameters bitwise (embedding, norms, lm_head; oneDNN keeps the packed linear
    # weights outside the module on CPU) and its computation — the policy's logprobs of the sampled tokens
    # are bitwise equal with the same drafter before and after two reloads.
    assert engine.target_digest() == target0 and target0["nonempty"] > 0
    assert [x.logprobs for x in c.completions] == [x.logprobs for x in a.completions]
    for x, y in zip(a.completions, b.completions):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


def test_reload_refuses_drafter_of_another_shape(engine, tmp_path):
    import torch
    from tailspec.drafter_trainer.export import export
    from tailspec.drafter_trainer.model import Eagle3Config, Eagle3Module
    from tailspec.rollout.vllm_backend import DrafterMismatch, greedy
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(tiny())
    torch.manual_seed(0)
    small_vocab = export(Eagle3Module(Eagle3Config.from_target(tc, draft_vocab_size=tc.vocab_size // 2)),
                         tmp_path / "half_vocab")
    before = engine.drafter_digest()
    with pytest.raises(DrafterMismatch, match="other tensors than the live one"):
        engine.reload_drafter(small_vocab)
    tc.hidden_size, tc.head_dim = 128, 32
    with pytest.raises(DrafterMismatch, match="hidden size 128, target has 256"):
        engine.reload_drafter(export(Eagle3Module(Eagle3Config.from_target(tc)), tmp_path / "h128"))
    assert engine.drafter_digest() == before  # nothing was loaded
    assert engine.generate(prompts(1), greedy(8)).completions[0].token_ids  # the engine still serves


def test_process_counters_read_what_vllms_own_reader_reads(engine):
    """`process_counters` (what a framework's engine actor runs through Ray's `__ray_call__` for the health
    guard) reads the Prometheus registry directly; vLLM's `LLM.get_metrics` is the independent reference."""
    from tailspec.rollout.vllm_backend import SpecCounters, counters_from_metrics, greedy, process_counters

    before = SpecCounters.from_dict(process_counters())
    res = engine.generate(prompts(), greedy(MAX_TOKENS))
    got = SpecCounters.from_dict(process_counters())
    assert got == counters_from_metrics(engine.llm.get_metrics())
    window = got - before
    assert window.drafts > 0 and (window.drafts, window.accepted_tokens) == (res.counters.drafts,
                                                                              res.counters.accepted_tokens)
    assert window.accepted_per_pos == res.counters.accepted_per_pos
