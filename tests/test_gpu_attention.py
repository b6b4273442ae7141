"""On CUDA, cuDNN's SDPA builds an execution plan the first time it meets a shape (45-65 ms on an H100:
BENCHMARKS.md, fourth GPU lease), and both a long tail (a new row count at every finished request) and a session
(a new padded width with most batches) meet new shapes all the time. The engine's forward and a session's teacher
keep cuDNN's kernel out, and the engine's grouped-query attention still reaches a fused kernel. Self-contained (no helpers from other test modules): benchmarks/gpu_checks.sh runs it
from outside the checkout against the installed package."""

from __future__ import annotations

import pytest
import torch
from tailspec.core.state import Sample
from tailspec.drafter_trainer.teacher import Teacher, collate
from tailspec.rollout.model_runner import ModelRunner
from transformers import LlamaConfig, LlamaForCausalLM


def small_llama(vocab: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def attention_ops(run) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return {e.key for e in prof.key_averages() if "attention" in e.key}


def teacher_at_three_widths(teacher: Teacher) -> None:
    for n, width in ((4, 30), (3, 41), (2, 17)):
        samples = [Sample(prompt_ids=[1, 5, 6], response_ids=[7] * (width - 3 - i), reward=1.0, policy_version=0)
                   for i in range(n)]
        teacher(collate(samples))


def runner_at_three_row_counts(runner: ModelRunner, device: str) -> None:
    for n in (16, 11, 5):
        runner.forward(torch.randint(0, 64, (n, 3), device=device), torch.full((n,), 40, device=device))


def test_the_probe_sees_sdpa_on_cpu():
    """What the GPU tests below rest on: both forwards reach SDPA, and the profiler names its kernel."""
    model = small_llama()
    assert "aten::scaled_dot_product_attention" in attention_ops(lambda: teacher_at_three_widths(Teacher(model, (1,))))
    runner = ModelRunner(model, max_slots=16, cache_len=128)
    assert "aten::scaled_dot_product_attention" in attention_ops(lambda: runner_at_three_row_counts(runner, "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_engine_forward_never_runs_cudnn_attention(dtype):
    runner = ModelRunner(small_llama().to("cuda", dtype), max_slots=16, cache_len=128)
    ops = attention_ops(lambda: runner_at_three_row_counts(runner, "cuda"))
    assert "aten::scaled_dot_product_attention" in ops
    assert not any("cudnn" in op for op in ops), sorted(ops)
    # GQA (4 query heads over 2 key/value heads) folded: a fused kernel, not the math fallback that `enable_gqa`
    # got without cuDNN (BENCHMARKS.md, fifth lease)
    assert "aten::_scaled_dot_product_efficient_attention" in ops, sorted(ops)


@pytest.mark.gpu
def test_gpu_teacher_never_runs_cudnn_attention():
    teacher = Teacher(small_llama().to("cuda"), (1,))
    ops = attention_ops(lambda: teacher_at_three_widths(teacher))
    assert "aten::scaled_dot_product_attention" in ops
    assert not any("cudnn" in op for op in ops), sorted(ops)
