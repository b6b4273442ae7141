"""The main job end to end: a 3-step co-trained demo with 2 workers on real Redis, real worker processes,
the real scheduler and real drafter sessions, on the tiny policy (from the default cache, which the
trainer's tiny acceptance test builds too): smaller policies decode so fast that their tail is over before a
session's first step."""

import json

import pytest

from tailspec import state

pytestmark = pytest.mark.slow

FIELDS = {"step", "mode", "step_time_s", "rollout_time_s", "train_time_s", "idle_gpu_seconds", "lent_gpu_seconds",
          "drafter_version", "acceptance_length", "acceptance_frozen", "acceptance_cotrained", "tokens",
          "rollout_tokens_per_s", "mean_reward", "accuracy", "policy_version", "logprob_max_abs_diff", "sessions",
          "measure_s", "wait_sessions_s"}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, redis_server):
    from tailspec.config import load_config
    from tailspec.demo.run import Demo, DemoOptions

    cfg = load_config(environ={})
    run_dir = tmp_path_factory.mktemp("run")
    # three steps: step 0's tail (~1 s) ends before a session's first step on 2 shared cores, so the later two
    # tails (~2-2.5 s each) are the chances to train; with one of them, a slow session start failed the run
    opts = DemoOptions(steps=3, workers=2, mode="cotrained", policy="tiny", prompts_per_step=32, group_size=4,
                       deal="by_length",  # the longest problems on one worker: a tail on every step
                       bootstrap_samples=64, bootstrap_seconds=5, validation_samples=8, run_dir=run_dir,
                       redis_url=redis_server.url, dashboard=True)
    demo = Demo(opts, cfg)
    return demo, demo.run()


def test_metrics_have_a_row_per_step_with_every_field(demo_run):
    demo, rows = demo_run
    lines = (demo.run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    for i, line in enumerate(lines):
        row = json.loads(line)
        assert FIELDS <= set(row), FIELDS - set(row)
        assert row["step"] == i and row["tokens"] > 0 and row["rollout_time_s"] > 0


def test_leases_granted_and_revoked(demo_run):
    import redis

    demo, rows = demo_run
    r = redis.Redis.from_url(demo.redis_url)
    events, _ = state.read_stream(r, state.key(demo.cluster, "events"), state.Event)
    kinds = [e.kind for _, e in events]
    assert "lease_granted" in kinds and "lease_revoked" in kinds
    assert sum(row.lent_gpu_seconds for row in rows) > 0
    # every lease was given back: no GPU is lent once the run is over
    assert not r.keys(state.key(demo.cluster, "lease", node="*", gpu="*"))


def test_a_candidate_was_trained(demo_run):
    """Sessions merged their steps into the one lineage (head 1 is the bootstrap drafter, 0 steps)."""
    from tailspec.drafter_trainer.checkpoint import load_checkpoint
    from tailspec.drafter_trainer.lineage import Lineage

    demo, _ = demo_run
    lin = Lineage(demo.run_dir / "drafter" / "lineage")
    heads = [load_checkpoint(p) for p in lin.root.glob("head-*")]
    assert heads, "the lineage has no head"
    steps = max(ck.trainer_state["lineage"]["steps"] for ck in heads)
    assert steps > 0, "no session merged a step into the lineage"


def test_export_directories_load(demo_run):
    import torch

    from tailspec.drafter_trainer.export import load_export
    from tailspec.tasks.policy import load_policy

    demo, _ = demo_run
    assert set(demo.exported) == {"eagle3", "hf"}, demo.export_errors
    cfg = json.loads((demo.run_dir / "export" / "eagle3" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    model, _ = load_policy(demo.policy_path)
    d_hf = load_export(demo.exported["hf"])  # brings its own embedding
    d_e3 = load_export(demo.exported["eagle3"], model.get_input_embeddings())
    for a, b in zip(d_hf.state_dict().values(), d_e3.state_dict().values()):
        assert torch.equal(a, b)


def test_rollout_logprobs_equal_plain_recomputation(demo_run):
    _, rows = demo_run
    assert max(r.logprob_max_abs_diff for r in rows) <= 1e-4


def test_report_and_plots_written(demo_run):
    from tailspec.demo.report import write_report
    from dataclasses import asdict

    demo, rows = demo_run
    report = write_report(demo.run_dir, [asdict(r) for r in rows], demo.timeline, {"mode": "cotrained"})
    text = report.read_text()
    assert "| 0 |" in text and "| 1 |" in text
    for png in ("timeline.png", "acceptance.png", "step_time.png", "reward.png"):
        data = (demo.run_dir / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert any(t["state"] == "lent" for t in demo.timeline)
