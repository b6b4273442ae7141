"""The main job end to end: a 3-step co-trained demo with 2 workers on real Redis, real worker processes,
the real scheduler and real drafter sessions, on the tiny policy (from the default cache, which the
trainer's tiny acceptance test builds too): smaller policies decode so fast that their tail is over before a
session's first step."""

import json

import pytest
import torch
from tailspec.core import state
from tailspec.core.state import Progress

pytestmark = pytest.mark.slow

FIELDS = {"step", "mode", "step_time_s", "rollout_time_s", "train_time_s", "idle_gpu_seconds", "lent_gpu_seconds",
          "drafter_version", "acceptance_length", "acceptance_frozen", "acceptance_cotrained", "tokens",
          "rollout_tokens_per_s", "mean_reward", "accuracy", "policy_version", "logprob_max_abs_diff", "sessions",
          "measure_s", "wait_sessions_s", "alt_style_share"}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, redis_server):
    from tailspec.core.config import load_config

    from tailspec.commands.demo import announcing_demo
    from tailspec.demo.options import DemoOptions

    cfg = load_config(environ={})
    run_dir = tmp_path_factory.mktemp("run")
    # three steps: step 0's tail (~1 s) ends before a session's first step on 2 shared cores, so the later two
    # tails (~2-2.5 s each) are the chances to train; with one of them, a slow session start failed the run
    opts = DemoOptions(steps=3, workers=2, mode="cotrained", policy="tiny", prompts_per_step=32, group_size=4,
                       deal="by_length",  # the longest problems on one worker: a tail on every step
                       bootstrap_samples=64, bootstrap_seconds=5, validation_samples=8, run_dir=run_dir,
                       redis_url=redis_server.url, dashboard=True)
    demo = announcing_demo(opts, cfg, on_started)
    return demo, demo.run()


STARTED: dict = {}


def on_started(demo):
    """The command's hook: services are up, no step has run; the dashboard's address is known and it serves."""
    import urllib.request

    STARTED["url"] = demo.dashboard_url
    STARTED["rows"] = len(demo.rows)
    try:  # a failure here is this test's, not the whole run's
        with urllib.request.urlopen(demo.dashboard_url + "/api/state", timeout=10) as resp:
            STARTED["status"] = resp.status
    except Exception as e:  # noqa: BLE001
        STARTED["status"] = repr(e)


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


def test_samples_point_at_the_targets_their_rollout_shipped(demo_run):
    """Every sample in the stream is a rollout's (the seeded bootstrap samples left with the first rollout's) and
    names its targets file; the files of versions the buffers no longer keep are pruned, the rest load whole."""
    import redis
    from tailspec.drafter_trainer.rollout_targets import load_targets

    demo, _ = demo_run
    r = redis.Redis.from_url(demo.redis_url)
    entries, _ = state.read_stream(r, state.key(demo.cluster, "samples"), state.Sample)
    samples = [s for _, s in entries]
    assert samples and not [s for s in samples if s.group_id.startswith("boot:")]
    root = demo.run_dir / "targets"
    assert all(s.states_path is not None and s.states_path.startswith(str(root)) for s in samples)
    keep = demo.policy_version - demo.cfg.trainer.keep_policy_versions
    assert {int(d.name[1:].split("-")[0]) for d in root.iterdir()} == set(range(keep, 3))
    kept = [s for s in samples if s.policy_version >= keep]
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in kept)
    got = load_targets(kept, _aux_ids(demo), width, torch.float32)
    assert got is not None and got.aux.shape[:2] == (len(kept), width)


def _aux_ids(demo):
    from tailspec.drafter_trainer.model import Eagle3Module

    return Eagle3Module.load(demo.frozen_path).config.aux_layer_ids


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
    from dataclasses import asdict

    from tailspec.demo.report import write_report

    demo, rows = demo_run
    report = write_report(demo.run_dir, [asdict(r) for r in rows], demo.timeline,
                          {"mode": "cotrained", "placement": demo.placement.note})
    text = report.read_text()
    assert "| 0 |" in text and "| 1 |" in text
    assert f"CPU split: {demo.placement.note}" in text  # the run says how it split the CPU
    share = sum(r.tail_idle_gpu_seconds for r in rows) / sum(len(r.worker_busy_s) * r.rollout_time_s for r in rows)
    assert 0 < share < 1 and f"(workers' clocks): {share:.2f}" in text  # deal=by_length: a tail every step
    for png in ("timeline.png", "acceptance.png", "step_time.png", "reward.png"):
        data = (demo.run_dir / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert any(t["state"] == "lent" for t in demo.timeline)


def test_the_dashboard_address_is_known_and_served_when_the_run_starts(demo_run):
    demo, _ = demo_run
    assert STARTED == {"url": demo.dashboard_url, "rows": 0, "status": 200}, STARTED


# -- the demo obeys its configuration (no run needed) ---------------------------------------------------------


@pytest.fixture(scope="module")
def micro_policy(tmp_path_factory):
    from tailspec.rl import save_policy_weights
    from tailspec.tasks.policy import build_model, build_tokenizer

    tok = build_tokenizer()
    return save_policy_weights(build_model("micro", tok), tok, tmp_path_factory.mktemp("micro") / "policy"), tok


def _item(policy, tok, rollout: dict, drafter_path: str | None = "ngram", n: int = 8):
    from tailspec.core.config import RolloutConfig

    from tailspec.demo.protocol import WorkItem, WorkRequest
    from tailspec.tasks.tokenizer import encode_prompt

    ids = encode_prompt(tok, "3+4+1=")
    reqs = [WorkRequest(rid=i, prompt_ids=ids, seed=i) for i in range(n)]
    return WorkItem(step=1, policy_path=str(policy), drafter_path=drafter_path, drafter_version=1, max_tokens=16,
                    requests=reqs, rollout=RolloutConfig(**rollout).model_dump(mode="json"))


def _worker(redis_url):
    from tailspec.demo.worker import Worker

    return Worker("w0", 0, redis_url, "cfgtest", "node0")


def test_set_rollout_reaches_the_work_items(tmp_path, redis_url):
    """`--set rollout.*` → Demo.send_work → every WorkItem carries the whole section (the demo's max_seq_len
    only where the user set none), and the worker reads it back unchanged."""
    import redis
    from tailspec.core.config import load_config

    from tailspec.demo.protocol import WorkItem, WorkRequest, work_key
    from tailspec.demo.run import Demo, DemoOptions
    from tailspec.demo.worker import rollout_config

    sets = ["rollout.selector=threshold", "rollout.k=2", "rollout.k_max=5", "rollout.epsilon=0.3",
            "rollout.max_batch=7", "rollout.cuda_graphs=false", "rollout.graph_memory_budget_mb=64",
            "rollout.dtype=bfloat16", "rollout.drafter=ngram"]
    for extra, seq in (([], 640), (["rollout.max_seq_len=800"], 800)):
        cfg = load_config(overrides=sets + extra, environ={})
        demo = Demo(DemoOptions(workers=2, run_dir=tmp_path, redis_url=redis_url), cfg)
        demo.redis_url = redis_url
        demo.cfg = demo.config()
        demo.r = redis.Redis.from_url(redis_url)
        demo.policy_path, demo.policy_version = "policy", 0
        share = [WorkRequest(rid=0, prompt_ids=[1, 2], seed=0)]
        demo.send_work(3, [share, share], "drafter", 1)
        for w in ("w0", "w1"):
            raw = demo.r.lpop(work_key(demo.cluster, w))
            item = state.decode(WorkItem, raw, where="test")
            assert (item.selector, item.k) == ("threshold", 2)
            assert rollout_config(item) == cfg.rollout.model_copy(update={"max_seq_len": seq})
        demo.r.close()


def test_given_cost_tables_go_to_each_worker_at_the_warm_up_only(tmp_path, redis_url):
    """DemoOptions.cost_tables: the warm-up's item for worker wN carries wN's table; a rollout's items carry none (a
    replacement worker's table is the demo's own record of its predecessor, not these)."""
    import redis
    from tailspec.core.config import load_config

    from tailspec.demo.protocol import WorkItem, WorkRequest, work_key
    from tailspec.demo.run import Demo, DemoOptions

    tables = {"w0": {"buckets": [1], "ks": [0], "table": [[1, 0, 0.5]]},
              "w1": {"buckets": [1], "ks": [0], "table": [[1, 0, 0.25]]}}
    demo = Demo(DemoOptions(workers=2, run_dir=tmp_path, redis_url=redis_url, cost_tables=tables),
                load_config(environ={}))
    demo.redis_url = redis_url
    demo.cfg = demo.config()
    demo.r = redis.Redis.from_url(redis_url)
    demo.policy_path, demo.policy_version = "policy", 0
    share = [WorkRequest(rid=0, prompt_ids=[1, 2], seed=0)]
    try:
        for warmup, want in ((True, tables), (False, {"w0": None, "w1": None})):
            demo.send_work(0, [share, share], "drafter", 1, warmup=warmup)
            for w in ("w0", "w1"):
                item = state.decode(WorkItem, demo.r.lpop(work_key(demo.cluster, w)), where="test")
                assert (item.warmup, item.cost_model) == (warmup, want[w])
    finally:
        demo.r.close()


def test_worker_engine_follows_the_rollout_config(micro_policy, redis_url):
    import torch
    from tailspec.rollout.selector import AdaptiveSelector

    policy, tok = micro_policy
    w = _worker(redis_url)
    try:
        item = _item(policy, tok, {"drafter": "ngram", "selector": "fixed", "k": 3, "k_max": 5, "max_batch": 3, "max_seq_len": 96,
                                       "dtype": "bfloat16"})
        eng = w._engine(item, _load(w, item))
        assert (eng.max_batch, eng.max_seq_len, eng.k_max) == (3, 96, 5)
        assert type(eng.drafter).__name__ == "NgramProposer" and next(w.model.parameters()).dtype == torch.bfloat16
        assert eng.selector(3, eng.last) == 3
        assert w.pool is None and eng.verify_forward == eng.runner.forward  # CPU: no CUDA graphs

        item = _item(policy, tok, {"drafter": "ngram", "selector": "adaptive", "epsilon": 0.3, "k_max": 2, "max_batch": 2,
                                       "max_seq_len": 96})
        eng = w._engine(item, _load(w, item))
        assert isinstance(eng.selector, AdaptiveSelector) and eng.selector.epsilon == 0.3
        assert eng.k_max == 2 and max(w.cost.ks) == 2 and max(w.cost.buckets) == 2

        item = _item(policy, tok, {"drafter": "none", "max_seq_len": 96})  # a drafter path, but plain decoding
        assert w._engine(item, _load(w, item)).drafter is None
        with pytest.raises(ValueError, match="draft_model"):  # the demo has no draft model: said, not ignored
            w.run_item(_item(policy, tok, {"drafter": "draft_model", "max_seq_len": 96}))
    finally:
        w.client.close()


def test_worker_starts_a_promoted_versions_tracker_from_its_validated_acceptance(micro_policy, redis_url, tmp_path):
    """With `rollout.drafter_carry` 0 a new drafter version resets the adaptive selector's acceptance tracker; the
    worker starts it from the version's validated acceptance (version.json), not the generic prior, and a version
    without one keeps it. With the default (1) the new version keeps its predecessor's counts."""
    from tailspec.core.state import DrafterVersion
    from tailspec.rollout.health_guard import chain_alpha

    policy, tok = micro_policy
    (tmp_path / "version.json").write_text(DrafterVersion(
        version=2, path=str(tmp_path), policy_version=0, acceptance_length=3.0, validation_k=4, promoted=True,
        created_at=0.0).model_dump_json())
    rollout = {"drafter": "ngram", "selector": "adaptive", "k_max": 4, "max_batch": 2, "max_seq_len": 96,
               "drafter_carry": 0.0}
    w = _worker(redis_url)
    try:
        item = _item(policy, tok, rollout)  # drafter v1 with no version.json: the generic prior
        w._engine(item, _load(w, item))
        generic = w.acceptance.prior
        item = _item(policy, tok, rollout, drafter_path=str(tmp_path)).model_copy(update={"drafter_version": 2})
        w._engine(item, _load(w, item))
        assert w.acceptance.drafter_version == 2
        assert w.acceptance.prior == pytest.approx(chain_alpha(3.0, 4)) != pytest.approx(generic)
        assert w.acceptance.alphas()[0] == pytest.approx(chain_alpha(3.0, 4), abs=0.02)
        # the default carry: version 3 keeps the counts version 2's rollout left
        w.run_item(item)
        rollout = {k: v for k, v in rollout.items() if k != "drafter_carry"}
        trials = list(w.acceptance.pos_trials)
        assert sum(trials) > 0
        item = _item(policy, tok, rollout, drafter_path=str(tmp_path)).model_copy(update={"drafter_version": 3})
        w._engine(item, _load(w, item))
        assert w.acceptance.drafter_version == 3 and w.acceptance.pos_trials == trials
    finally:
        w.client.close()


def _load(w, item):
    from tailspec.demo.worker import rollout_config

    rc = rollout_config(item)
    w._load_policy(item, rc)
    w._load_drafter(item, rc)
    return rc


def test_worker_rollouts_do_not_depend_on_the_drafter_under_the_coupled_rule(micro_policy, redis_url):
    """rollout.verify_rule coupled (the default): a worker's responses are the same tokens, request by request,
    with no drafter, n-gram drafts at fixed k = 1 and 3, and the adaptive selector, so a run's modes decode the
    same rollouts; under the residual rule the drafts change them."""
    policy, tok = micro_policy
    w = _worker(redis_url)
    try:
        def tokens(rollout: dict) -> dict[int, list[int]]:
            res = w.run_item(_item(policy, tok, {"max_seq_len": 96, **rollout}))
            return {o.rid: o.token_ids for o in res.outputs}

        plain = tokens({"drafter": "none"})
        assert len(plain) == 8 and all(plain.values())
        for k in (1, 3):
            assert tokens({"drafter": "ngram", "selector": "fixed", "k": k}) == plain
        assert tokens({"drafter": "ngram", "selector": "adaptive"}) == plain
        assert tokens({"drafter": "ngram", "selector": "fixed", "k": 3, "verify_rule": "residual"}) != plain
        # the drain's report says the engine's memory is given back (the scheduler lends on it at once)
        assert w.client.flush(5)
        p = state.get(w.r, state.key("cfgtest", "progress", worker="w0"), Progress)
        assert p is not None and (p.active, p.finished, p.mem_released) == (0, 8, True) and w.pool is None
    finally:
        w.client.close()


def _ngram_worker_with_cost(micro_policy, redis_url):
    """(worker, item, rollout config): a worker on the micro policy with an n-gram drafter at fixed k = 2, its
    cost table timed eagerly (CPU: no pool attached by `_engine`)."""
    policy, tok = micro_policy
    w = _worker(redis_url)
    item = _item(policy, tok, {"drafter": "ngram", "selector": "fixed", "k": 2, "k_max": 3, "max_batch": 4,
                               "max_seq_len": 96})
    rc = _load(w, item)
    w._measure_cost(w._engine(item, rc), item, rc)
    return w, item, rc


def test_worker_graph_pool_replays_the_same_tokens(micro_policy, redis_url):
    """rollout.cuda_graphs builds the pool from the worker's cost model, capturing the draft lengths the
    configured selector picks (on CPU: the same plan's padded static-buffer path, emulated); the pooled
    engine decodes exactly what the eager one does (greedy: no sampling ties at float noise)."""
    from tailspec.rollout.sequence import SamplingParams

    from tailspec.demo.worker import attach_graph_pool

    w, item, rc = _ngram_worker_with_cost(micro_policy, redis_url)
    try:
        outs = {}
        for pooled in (False, True):
            eng = w._engine(item, rc)
            if pooled:
                assert attach_graph_pool(eng, rc.model_copy(update={"cuda_graphs": False}), w.cost, emulate=True) is None
                pool = attach_graph_pool(eng, rc, w.cost, emulate=True)
                assert pool.graphs and eng.verify_forward == pool.forward
                assert {k for _, k in pool.plan.pairs()} == {2}  # the fixed selector's k only
            params = [SamplingParams(max_tokens=16, temperature=0.0) for _ in item.requests]
            outs[pooled] = [o.token_ids for o in eng.generate([r.prompt_ids for r in item.requests], params)]
        assert pool.replays > 0 and outs[True] == outs[False]
    finally:
        w.client.close()


def test_the_cost_table_is_timed_again_through_the_graph_pool_once(redis_url, micro_policy):
    """With a graph pool the selector reads a table timed through the replays (a replayed verify costs a fraction
    of the eager one on a GPU): the first attach re-times it through the pool, later engines of that shape reuse it."""
    w, item, rc = _ngram_worker_with_cost(micro_policy, redis_url)
    try:
        eager = w.cost
        assert not w.cost_graphed
        eng = w._engine(item, rc)
        w._attach_pool(eng, item, rc, emulate=True)
        assert w.pool is not None and w.pool.replays > 0  # the new table's steps ran through the pool
        assert w.cost_graphed and w.cost is not eager and w.cost.buckets == eager.buckets
        graphed = w.cost
        w._attach_pool(w._engine(item, rc), item, rc, emulate=True)
        assert w.cost is graphed and w.pool.replays == 0  # same shape: reused, not timed again
    finally:
        w.client.close()


# -- what the command prints ------------------------------------------------------------------------------------


def _row(**kw):
    from tailspec.demo.run import StepRow

    base = {"step": 123, "mode": "cotrained", "step_time_s": 123.4, "rollout_time_s": 99.9, "train_time_s": 23.5, "measure_s": 3.0,
                "wait_sessions_s": 0.1, "idle_gpu_seconds": 123.4, "lent_gpu_seconds": 123.4, "drafter_version": 123,
                "acceptance_length": 2.36, "acceptance_frozen": 2.28, "acceptance_cotrained": 2.36, "tokens": 99999,
                "rollout_tokens_per_s": 12345.0, "mean_reward": 0.62, "accuracy": 0.6, "policy_version": 124,
                "logprob_max_abs_diff": 1e-6, "sessions": 3}
    base.update(kw)
    return StepRow(**base)


def _render(*renderables, width: int = 80) -> str:
    import io

    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, legacy_windows=False)
    for r in renderables:
        console.print(r)
    return buf.getvalue()


def test_step_table_fits_80_columns_with_whole_headers():
    from tailspec.commands.demo import STEP_COLUMNS, step_table

    rows = [_row(step=0, drafter_version=None, acceptance_frozen=None, acceptance_cotrained=None,
                 rollout_tokens_per_s=980.0), _row()]
    out = _render(step_table(rows))
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80, out
    assert "…" not in out, out
    import re

    top, bottom = lines[1], lines[2]  # under the title, the two header lines: every header whole
    for col in STEP_COLUMNS:
        *first, last = col.split("\n")
        assert re.search(rf"(^|\s){re.escape(last)}(\s|$)", bottom), (col, out)
        for part in first:
            assert re.search(rf"(^|\s){re.escape(part)}(\s|$)", top), (col, out)
    for cell in ("123.4", "v123", "2.36/2.28", "12345", "0.62", "-/-"):
        assert cell in out, (cell, out)


def test_intro_lines_fit_80_columns():
    from tailspec.commands.demo import intro_lines, policy_line
    from tailspec.tasks.policy import PRESETS

    meta = {"params": 12_345_678, "accuracy": 0.578, "len_p50": 143, "len_p90": 995, "len_p99": 1999}
    lines = [policy_line(p, "runsum") for p in PRESETS] + intro_lines("64 simulated GPUs (128 asked, 64 cores), 1 own core each", meta)
    out = _render(*lines)
    assert len(out.splitlines()) == len(lines), out  # none wrapped
    assert max(len(line) for line in out.splitlines()) <= 80, out


def test_log_records_print_on_lines_of_their_own_above_the_live_table():
    import io
    import logging

    from rich.console import Console
    from rich.live import Live

    from tailspec.commands.demo import _ConsoleLog, step_table

    buf = io.StringIO()
    console = Console(file=buf, width=80, force_terminal=True, color_system=None, legacy_windows=False)
    root = logging.getLogger()
    plain = logging.StreamHandler(io.StringIO())
    root.addHandler(plain)
    try:
        with Live(step_table([_row()]), console=console, auto_refresh=False, transient=False), _ConsoleLog(console):
            assert plain not in root.handlers
            logging.getLogger("tailspec.demo").warning("bootstrap drafter: 256 samples")
        assert plain in root.handlers
    finally:
        root.removeHandler(plain)
    import re

    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue()).replace("\r", "\n")  # cursor moves, erasures
    assert any(line.strip() == "WARNING tailspec.demo: bootstrap drafter: 256 samples" for line in text.split("\n")), text
    assert plain.stream.getvalue() == ""


def test_the_lineage_starts_with_the_bootstrap_runs_optimizer_state(demo_run, redis_url, tmp_path):
    """The first head carries the offline run's AdamW moments: the first sessions continue that optimizer
    instead of starting Adam afresh (whose first steps move every weight by about the full lr)."""
    import redis
    from tailspec.core.config import load_config
    from tailspec.drafter_trainer.checkpoint import load_checkpoint
    from tailspec.drafter_trainer.lineage import Lineage

    from tailspec.demo.bootstrap import load_optimizer, seed_store

    demo, _ = demo_run
    saved = load_optimizer(demo.frozen_path)
    assert saved is not None and saved["state"], "the bootstrap drafter was cached without its optimizer state"
    assert all(int(v["step"]) > 0 for v in saved["state"].values())
    cfg = load_config(overrides=["cluster.name=seedtest", f"trainer.checkpoint_dir={tmp_path}"], environ={})
    r = redis.Redis.from_url(redis_url)
    seed_store(demo.frozen_path, cfg, r)
    head = Lineage(tmp_path / "lineage", r, "seedtest").head()
    ck = load_checkpoint(head.path)
    assert ck.optimizer_state is not None and ck.optimizer_state["state"].keys() == saved["state"].keys()
    r.close()


def test_worker_health_guard_trips_on_a_broken_drafter_and_decodes_exactly(micro_policy, redis_url, tmp_path):
    """A drafter version whose fc is zeroed after load (the weight-sync failure RL users report): the worker's
    guard trips within one window, the event is recorded, the rest of the rollout runs k = 0, and the tokens are
    exactly plain decoding's (greedy). The same version after a policy sync stays off; a new version is tried."""
    import redis
    import torch
    from tailspec.core.state import DrafterVersion, Event

    from tailspec.tasks.policy import load_policy
    from tests.engine_helpers import random_eagle3

    policy, tok = micro_policy
    target, _ = load_policy(str(policy))
    d = random_eagle3(target, draft_vocab_size=target.config.vocab_size)
    with torch.no_grad():  # every weight of the head zeroed (the embedding is the target's, not saved with it)
        for p in d.parameters():
            p.zero_()
    for v in (1, 2):
        d.save(tmp_path / f"v{v}")
        (tmp_path / f"v{v}" / "version.json").write_text(DrafterVersion(
            version=v, path=str(tmp_path / f"v{v}"), policy_version=0, acceptance_length=2.5, validation_k=4,
            promoted=True, created_at=0.0).model_dump_json())
    rollout = {"drafter": "eagle3", "selector": "fixed", "k": 3, "k_max": 4, "max_batch": 4, "max_seq_len": 96,
               "guard_window_steps": 4}
    w = _worker(redis_url)
    try:
        item = _item(policy, tok, rollout, drafter_path=str(tmp_path / "v1"), n=4).model_copy(
            update={"temperature": 0.0})
        res = w.run_item(item)
        assert w.guard.version == 1 and not w.guard.speculate
        tripped = [v for v in res.guard if v["tripped"]]
        assert len(tripped) == 1 and tripped[0]["steps"] == 4 and tripped[0]["event"] == "load"
        ks = [int(k) for k in res.strategy_mix]
        assert 0 in ks and 3 in ks and res.strategy_mix["3"] == 4  # one window at k = 3, then plain decoding
        first = res
        events = [state.decode(Event, f[b"data"]) for _, f in redis.Redis.from_url(redis_url).xrange(
            state.key("cfgtest", "events"))]
        assert any(e.kind == "drafter_guard" and e.detail["tripped"] and e.detail["version"] == 1 for e in events)
        status = state.decode(state.GuardStatus, redis.Redis.from_url(redis_url).hget(
            state.key("cfgtest", "drafter_guard"), w.name))  # what the dashboard's guard banner reads
        assert status.tripped and status.version == 1 and status.event == "load" and status.worker == w.name

        synced = item.model_copy(update={"policy_version": 1})  # new weights, same drafter version
        res = w.run_item(synced)
        assert set(res.strategy_mix) == {"0"} and w.guard.event == "policy_sync"
        res = w.run_item(item.model_copy(update={"drafter_path": str(tmp_path / "v2"), "drafter_version": 2}))
        assert w.guard.event == "reload" and res.strategy_mix.get("3", 0) >= 1  # tried again (and judged)
        w2 = _worker(redis_url)
        try:  # plain decoding in a worker of its own: the broken drafter's rollout decoded exactly the same
            plain = w2.run_item(item.model_copy(update={"drafter_path": None, "drafter_version": None}))
        finally:
            w2.client.close()
        assert [o.token_ids for o in first.outputs] == [o.token_ids for o in plain.outputs]
    finally:
        w.client.close()


def test_lent_in_tail_counts_lent_time_inside_each_workers_idle_tail():
    """Hand-computed: w0 done at 10, w1 at 14 (the step's last result). GPU 0 lent 10.3-13.0 and again 13.5-15
    (clipped at 14): 2.7 + 0.5 of w0's 4 idle seconds; GPU 1 lent after its own finish counts nothing."""
    from tailspec.demo.report import lent_in_tail

    tl = [
        {"node": "n", "gpu": 0, "state": "generating", "since": 1.0, "worker": "w0"},
        {"node": "n", "gpu": 0, "state": "lent", "since": 10.3, "worker": "w0"},
        {"node": "n", "gpu": 0, "state": "reclaiming", "since": 13.0, "worker": "w0"},
        {"node": "n", "gpu": 0, "state": "lent", "since": 13.5, "worker": "w0"},
        {"node": "n", "gpu": 0, "state": "unknown", "since": 15.0, "worker": "w0"},
        {"node": "n", "gpu": 1, "state": "lent", "since": 14.2, "worker": "w1"},
    ]
    lent, idle = lent_in_tail([{"worker_finished_at": {"w0": 10.0, "w1": 14.0}}], tl)
    assert idle == pytest.approx(4.0) and lent == pytest.approx(3.2)
    assert lent_in_tail([{"worker_finished_at": {}}], tl) == (0.0, 0.0)  # rows recorded before the field


def test_worker_syncs_a_new_policy_version_into_its_loaded_module(micro_policy, redis_url, tmp_path):
    """A new policy version of the same config is loaded into the worker's module (as an RL framework syncs its
    rollout engine's weights): the same module object, the new version's weights exactly (the reference: the
    directory loaded afresh); a policy of another config is built anew."""
    from tailspec.benchmarks.vllm_kit import perturbed_policy

    from tailspec.tasks.policy import load_policy

    policy, tok = micro_policy
    w = _worker(redis_url)
    try:
        item = _item(policy, tok, {"drafter": "none"})
        _load(w, item)
        first = w.model
        moved = perturbed_policy(policy, tmp_path / "v1", scale=0.2)
        _load(w, item.model_copy(update={"policy_path": str(moved), "policy_version": 1}))
        assert w.model is first
        ref, _ = load_policy(moved)
        got, want = w.model.state_dict(), ref.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert not torch.equal(got["lm_head.weight"], load_policy(policy)[0].state_dict()["lm_head.weight"])
        other = perturbed_policy(policy, tmp_path / "v2", scale=0.0)
        cfg = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-6}))  # another config
        _load(w, item.model_copy(update={"policy_path": str(other), "policy_version": 2}))
        assert w.model is not first and w.model.config.rms_norm_eps == 1e-6
    finally:
        w.client.close()


def test_a_warm_up_given_a_cost_table_keeps_it_and_still_seeds_the_acceptance_tracker(micro_policy, redis_url):
    """DemoOptions.cost_tables → WorkItem.cost_model on the warm-up: the worker runs its warm-up steps (its acceptance
    tracker folds in as many as a worker that times its own table) and then keeps the given table, not its timings;
    a table for another strategy space is not taken."""
    from tailspec.rollout.cost_model import CostModel

    policy, tok = micro_policy
    rollout = {"max_seq_len": 96, "drafter": "ngram", "selector": "adaptive", "k": 2, "k_max": 2, "trees": False}
    warm = _item(policy, tok, rollout).model_copy(update={"warmup": True})
    own, given_w, other = _worker(redis_url), _worker(redis_url), _worker(redis_url)
    try:
        timed = own.run_item(warm).cost_model
        assert timed is not None and own.acceptance.updates > 0
        t = CostModel.from_dict(timed)
        mine = CostModel(t.buckets, t.ks, {key: 7.0 * v + 1.0 for key, v in t.table.items()}).to_dict()
        got = given_w.run_item(warm.model_copy(update={"cost_model": mine})).cost_model
        assert got == mine and got != timed
        assert given_w.acceptance.updates == own.acceptance.updates  # the same warm-up steps ran
        wrong = CostModel(t.buckets[:1], [0, 1], {(t.buckets[0], 0): 1.0, (t.buckets[0], 1): 2.0}).to_dict()
        assert other.run_item(warm.model_copy(update={"cost_model": wrong})).cost_model != wrong
    finally:
        for w in (own, given_w, other):
            w.client.close()
