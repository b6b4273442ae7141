"""TRL's GRPOTrainer generating with its colocated vLLM engine (vLLM's CPU build) and tailspec attached: the engine
speculates with tailspec's EAGLE-3 drafter, a version promoted in Redis after an optimizer step is loaded before the
next rollout's generation, TRL's weight sync keeps working (on CPU through `cpu_weight_sync`), and the rollout's
phases and samples flow as without vLLM. `make test-trl-vllm` runs it (TRL beside the vLLM venv)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("trl")
pytest.importorskip("vllm")

from tailspec.core import state
from tailspec.core.state import DrafterVersion, Sample
from tailspec.rollout.vllm_backend import SpecCounters, process_counters
from transformers import TrainerCallback
from vllm_helpers import drafters, prompts, tiny

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
CLUSTER, STEPS, K = "trlv", 3, 3


def _promote(r, version: int, path) -> None:
    state.put(r, state.key(CLUSTER, "drafter_current"), DrafterVersion(
        version=version, path=str(path), policy_version=0, acceptance_length=2.5, validation_k=K, promoted=True,
        created_at=time.time()))


def greedy_acceptance(llm) -> float:
    """Tokens per target forward of greedy decoding of the task's prompts through the live engine (vLLM's own
    counters, read in this process)."""
    from vllm import SamplingParams

    before = SpecCounters.from_dict(process_counters())
    llm.generate([{"prompt_token_ids": p} for p in prompts(4)], SamplingParams(max_tokens=32, temperature=0.0),
                 use_tqdm=False)
    return (SpecCounters.from_dict(process_counters()) - before).acceptance_length


class PromoteAfterFirstStep(TrainerCallback):
    """After optimizer step 1: the engine's acceptance with the drafter it started with, then a promotion."""

    def __init__(self, redis_client, trained):
        self.r, self.trained, self.trainer, self.before = redis_client, trained, None, None

    def on_step_end(self, args, state_, control, **kw):
        if state_.global_step == 1:
            self.before = greedy_acceptance(self.trainer.vllm_generation.llm)
            _promote(self.r, 2, self.trained)


def test_trl_vllm_engine_speculates_and_loads_promoted_drafters(redis_url, redis_client, tmp_path):
    import torch
    from tailspec.scheduler.client import TailspecClient
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig

    from tailspec.integrations.trl import TailspecAttach, TailspecGRPOTrainer
    from tailspec.integrations.trl_example import build_dataset, runsum_reward, tokenizer_with_bos

    d, policy = drafters(), tiny()
    _promote(redis_client, 1, d["untrained"])
    attach = TailspecAttach(TailspecClient(redis_url, cluster=CLUSTER, node="n0"), tmp_path / "policy",
                            drafter_path=d["untrained"], drafter_version=1, drafter_k=K, guard=None)
    cfg = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=STEPS, seed=0,
                     per_device_train_batch_size=8, num_generations=4, max_completion_length=32, learning_rate=1e-5,
                     logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, use_vllm=True,
                     vllm_mode="colocate", vllm_max_model_length=256, vllm_enable_sleep_mode=False, bf16=False)  # fp32 on the CPU
    cb = PromoteAfterFirstStep(redis_client, d["trained"])
    trainer = TailspecGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32),
                                  reward_funcs=runsum_reward, args=cfg, train_dataset=build_dataset("task", 64, 0, 2, 1),
                                  processing_class=tokenizer_with_bos(policy), callbacks=[cb], tailspec=attach)
    cb.trainer = trainer
    llm = trainer.vllm_generation.llm
    spec = llm.llm_engine.vllm_config.speculative_config
    assert spec.method == "eagle3" and spec.num_speculative_tokens == K  # TRL's engine, tailspec's arguments
    assert trainer.vllm_generation.sync_weights.__func__.__module__ == "tailspec.integrations.trl_vllm"  # CPU sync
    trainer.train()

    # v2 was promoted after step 1 and loaded before step 2's generation, once; v1 was the start
    assert [(x["version"], x["event"]) for x in trainer.live.loads] == [(2, "reload")]
    assert trainer.live.version.version == 2 and trainer.live.ro.drafter_path == d["trained"]
    assert cb.before < 1.1 < 2.0 < greedy_acceptance(llm)  # untrained drafts ~never accepted; the trained one's are

    # the rollouts went on as without vLLM: TRL synced its weights each step, phases and samples flowed
    assert trainer.state.global_step == STEPS and len([h for h in trainer.state.log_history if "loss" in h]) == STEPS
    attach.client.flush(5.0)
    got, _ = state.read_stream(redis_client, state.key(CLUSTER, "samples"), Sample)
    assert sorted({s.policy_version for _, s in got}) == list(range(STEPS))
    assert attach.stats.published == list(range(STEPS + 1))
    attach.close()
