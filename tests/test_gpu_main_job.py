"""The main job on a GPU (`--device cuda`): the `gpu` policy preset, N simulated GPUs planned onto one device
(CUDA MPS shares or time-slicing), sessions started on their simulated GPU's device and share, the shared device's
NVML readings in every share's telemetry, and the CPU paths that stay what they were. The tests marked `gpu` run
the same paths on CUDA and skip cleanly without it."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from engine_helpers import hf_greedy
from tailspec.core.config import TailspecConfig
from tailspec.demo import device_share
from tailspec.demo.device_share import MpsDaemon, assign, plan, thread_percentage
from tailspec.demo.options import GPU_POLICY, DemoOptions, policy_for
from tailspec.demo.services import place_workers, resolve_device
from tailspec.rollout.engine import Engine
from tailspec.rollout.sequence import SamplingParams
from tailspec.scheduler.dispatch import LocalDispatcher
from tailspec.scheduler.session_process import SessionContext
from tailspec.scheduler.telemetry import SharedDevice, SimulatedTelemetry
from tailspec.tasks.policy import PRESETS, build_model, load_policy, model_config
from tailspec.tasks.runsum import sample_problems
from tailspec.tasks.tokenizer import build_tokenizer, encode_prompt, save_tokenizer

# --- the preset ------------------------------------------------------------------------------------------------


def _params(cfg) -> int:
    """A Llama config's parameter count from its shapes (no weights built)."""
    h, i, layers, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return layers * per_layer + 2 * v * h + h


def test_gpu_preset_is_memory_bound_sized_with_gqa():
    p = PRESETS["gpu"]
    cfg = model_config(p, build_tokenizer())
    n = _params(cfg)
    # bf16 weights large enough that reading them outlasts a decode step's kernel launches on an H100 / H200
    assert 0.5e9 < n < 1.0e9, n
    assert 2 * n > 1.0e9  # bytes in bf16
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped-query attention
    assert cfg.hidden_size // cfg.num_attention_heads == 128
    # an EAGLE-3 drafter is one decoder layer at the target's width: a small fraction of a target forward
    assert 1 / cfg.num_hidden_layers <= 1 / 16
    assert p.prefer_cuda and not PRESETS["deep"].prefer_cuda  # built on CUDA where there is one; never a CPU default
    assert DemoOptions().policy == "deep" and policy_for(None, "cuda") == GPU_POLICY == "gpu"
    assert policy_for(None, "cpu") == policy_for(None, "auto") == "deep" and policy_for("tiny", "cuda") == "tiny"


@pytest.mark.slow
def test_gpu_preset_builds_and_decodes_on_cpu(tmp_path):
    """Built from the preset, saved in bf16 and loaded back through `from_pretrained`, the engine's greedy decoding
    equals HF `generate` (untrained weights: the shapes and the code path are what is checked). Both decode in fp32:
    an untrained model's logits are near ties, which bf16 rounding would break differently in the two."""
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = build_model("gpu", tok).to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    save_tokenizer(tok, tmp_path)
    del model
    assert load_policy(tmp_path, dtype=torch.bfloat16)[0].dtype == torch.bfloat16  # the rollouts' dtype on a GPU
    model, tok = load_policy(tmp_path, dtype=torch.float32)
    assert model.config.num_hidden_layers == 16
    prompt = encode_prompt(tok, sample_problems(1, seed=3)[0].prompt)
    want = hf_greedy(model, prompt, 6, eos=tok.eos_token_id, pad=tok.pad_token_id)
    engine = Engine(model, None, max_batch=1, max_seq_len=len(prompt) + 8, k_max=0)
    got = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0].token_ids
    assert got == want


# --- simulated GPUs on one device -------------------------------------------------------------------------------


def test_plan_shares_one_device_under_mps(tmp_path):
    assert assign(4, 1) == [0, 0, 0, 0] and assign(4, 2) == [0, 1, 0, 1]
    assert thread_percentage(4) == 25 and thread_percentage(3) == 33 and thread_percentage(200) == 1
    with pytest.raises(ValueError, match="needs a CUDA device"):
        assign(4, 0)
    mps = MpsDaemon(tmp_path)
    shares = plan(4, 1, mps)
    assert shares.shared and shares.devices == [0, 0, 0, 0] and shares.mps is mps
    assert "MPS 25%" in shares.sharing
    for env in shares.env:
        assert env["CUDA_VISIBLE_DEVICES"] == "0"
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps-pipe")
    # two devices: two GPUs on each, half of each device's SMs
    two = plan(4, 2, mps)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in two.env] == ["0", "1", "0", "1"]
    assert {e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for e in two.env} == {"50"}


def test_plan_time_slices_without_mps_and_says_why():
    shares = plan(3, 1, None, "nvidia-cuda-mps-control not found")
    assert shares.shared and "time-sliced (nvidia-cuda-mps-control not found)" in shares.sharing
    assert all("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in e for e in shares.env)
    own = plan(2, 4, None)  # enough devices: one each, nothing shared
    assert not own.shared and [e["CUDA_VISIBLE_DEVICES"] for e in own.env] == ["0", "1"]
    assert "one each" in own.sharing


def test_mps_daemon_reports_why_it_cannot_start(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-cuda-mps-control anywhere
    d = MpsDaemon(tmp_path / "mps")
    assert d.start() == "nvidia-cuda-mps-control not found"
    assert not d.running
    # a control binary that starts but whose clients fail: the daemon is quit and the reason given
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "calls.log"
    ctl = bindir / "nvidia-cuda-mps-control"
    ctl.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\ncat >> {log}\nexit 0\n")
    ctl.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    monkeypatch.setattr(device_share, "_PROBE", "import sys; sys.exit('no CUDA here')")
    why = d.start(timeout_s=30)
    assert why is not None and "no CUDA here" in why
    assert not d.running and log.read_text().split() == ["-d", "quit"]  # started with -d, then told to quit
    assert not (tmp_path / "mps").exists()  # its pipe and log directories go with it


def test_resolve_device_and_placement():
    if not torch.cuda.is_available():
        assert resolve_device("auto") == "cpu"
        with pytest.raises(ValueError, match="--device cpu"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        resolve_device("tpu")
    cfg = TailspecConfig()
    with pytest.raises(ValueError, match="device shares"):
        place_workers(2, cfg, "cuda", None)
    shares = plan(2, 1, None, "test")
    p = place_workers(2, cfg, "cuda", shares)
    assert p.device == "cuda" and p.cpus is None and p.env == shares.env and "time-sliced" in p.note
    on_cpu = place_workers(2, cfg, "cpu")
    assert on_cpu.device == "cpu"
    assert on_cpu.env is None if not torch.cuda.is_available() else on_cpu.env[0] == {"CUDA_VISIBLE_DEVICES": ""}


def test_sessions_start_on_their_simulated_gpus_device(tmp_path, monkeypatch):
    """The dispatcher starts a session lent simulated GPU g with g's device and MPS share (scheduler
    .simulated_gpu_env), over the dispatcher's own CUDA_VISIBLE_DEVICES = g."""
    started: list[dict] = []

    class _Popen:
        def __init__(self, cmd, env=None, **kw):
            started.append(env)
            self.pid, self.returncode = 4242, None

        def poll(self):
            return None

    monkeypatch.setattr(subprocess, "Popen", _Popen)
    shares = plan(4, 1, MpsDaemon(tmp_path))
    d = LocalDispatcher("tests.lineage_entry:ENTRY", log_dir=str(tmp_path), gpu_env=dict(enumerate(shares.env)))
    ctx = SessionContext(session_id="s1", node="n0", gpu=3, lease_token=1, redis_url="redis://x", cluster="c")
    d.start(ctx)
    env = started[-1]
    assert env["CUDA_VISIBLE_DEVICES"] == "0"  # not "3": the device simulated GPU 3 is a share of
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    # without a plan, the lent GPU's own index as before
    d2 = LocalDispatcher("tests.lineage_entry:ENTRY", log_dir=str(tmp_path))
    d2.start(replace(ctx, session_id="s2"))
    assert started[-1]["CUDA_VISIBLE_DEVICES"] == "3" and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in started[-1]


class _OneDeviceNvml:
    """A test double of the nvidia-ml-py API: one device at 64% with 10 of 80 GiB in use."""

    class NVMLError(Exception):
        pass

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=64)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=10 << 30, total=80 << 30)

    def nvmlDeviceGetPowerUsage(self, h):
        return 300_000


def test_shares_carry_the_devices_nvml_readings(redis_client):
    shared = SharedDevice(0, "CUDA MPS 25% of the SMs each", nvml=_OneDeviceNvml())
    t = SimulatedTelemetry("n0", redis_client, "c-shared", num_gpus=4, seed=0, shared_device=shared)
    samples = t.sample()
    assert len(samples) == 4
    for s in samples:
        assert s.simulated  # the share's utilisation is the simulation's: NVML cannot tell shares apart
        assert s.device == "cuda:0, CUDA MPS 25% of the SMs each"
        assert s.device_util == 64.0 and s.device_mem_used == 10 << 30 and s.device_mem_total == 80 << 30
    plain = SimulatedTelemetry("n0", redis_client, "c-shared", num_gpus=2, seed=0).sample()
    assert all(s.device is None and s.device_util is None for s in plain)
    # a device NVML does not have: labelled, no figures
    assert SharedDevice(3, "", nvml=_OneDeviceNvml()).read() == {"device": "cuda:3"}


def test_demo_config_hands_sessions_the_plan(tmp_path):
    """The demo's config carries the plan to the scheduler: per GPU environment, the shared device and its label."""
    from tailspec.demo.run import Demo

    shares = plan(2, 1, MpsDaemon(tmp_path))
    demo = Demo.__new__(Demo)  # the config step only: no services
    demo.o = DemoOptions(workers=2, mode="cotrained")
    demo.base_cfg, demo.cluster, demo.redis_url = TailspecConfig(), "c", "redis://127.0.0.1:1"
    demo.placement = place_workers(2, demo.base_cfg, "cuda", shares)
    demo.shares = shares
    demo.policy_src, demo.run_dir = None, tmp_path / "run"
    cfg = demo.config()
    assert cfg.scheduler.simulated_gpu_env == {0: shares.env[0], 1: shares.env[1]}
    assert cfg.scheduler.simulated_gpu_device == 0 and "MPS 50%" in cfg.scheduler.simulated_gpu_sharing
    json.dumps(cfg.model_dump(mode="json"))  # travels to scheduler processes as JSON / YAML


# --- on CUDA ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_grpo_step_on_cuda_equals_cpu():
    from engine_helpers import micro_policy
    from tailspec.rl import Rollout, grpo_step, recompute_logprobs

    model, tok = micro_policy()
    rolls = [Rollout([1, 5, 6], [7, 8, 2], [-1.0, -1.2, -0.5], r, 0) for r in (0.0, 1.0)]
    ref = recompute_logprobs(model, rolls, tok.pad_token_id)
    on_gpu = recompute_logprobs(model.to("cuda"), rolls, tok.pad_token_id)
    assert max(abs(a - b) for x, y in zip(ref, on_gpu) for a, b in zip(x, y)) < 1e-4
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    stats = grpo_step(model, opt, rolls, tok.pad_token_id)
    assert stats.tokens == 6 and all(p.device.type == "cuda" for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.slow
def test_demo_runs_on_cuda(tmp_path):
    """Two steps of the co-trained demo with 2 simulated GPUs on the device (MPS or time-sliced, as the run says),
    the micro4 policy: workers, sessions and the update on CUDA, the report written."""
    from tailspec.demo.run import Demo

    opts = DemoOptions(steps=2, workers=2, policy="micro4", device="cuda", run_dir=tmp_path / "run", dashboard=False,
                       live=False, plots=False, bootstrap_samples=32, bootstrap_steps=5, measure_samples=4,
                       prompts_per_step=4, group_size=2, max_tokens=64, max_seq_len=160)
    demo = Demo(opts, TailspecConfig())
    rows = demo.run()
    assert len(rows) == 2 and demo.placement.device == "cuda"
    assert next(demo.model.parameters()).device.type in ("cuda", "cpu")
    assert "CUDA" in demo.placement.note
    logs = "".join(p.read_text() for p in Path(tmp_path / "run").glob("worker-w*.log"))
    assert "Traceback" not in logs
