import pytest
from tailspec.core.config import ConfigError, TailspecConfig, dump_config, env_overrides, load_config


def test_defaults_validate_and_round_trip(tmp_path):
    cfg = load_config(environ={})
    assert isinstance(cfg, TailspecConfig)
    f = tmp_path / "c.yaml"
    f.write_text(dump_config(cfg))
    assert load_config(f, environ={}) == cfg


def test_precedence_file_env_cli(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("scheduler:\n  lease_ttl_s: 3\n  stop_deadline_s: 0.5\ntrainer:\n  lr: 0.01\n")
    env = {"TAILSPEC_SCHEDULER__LEASE_TTL_S": "4", "TAILSPEC_ROLLOUT__K": "6"}
    cfg = load_config(f, ["scheduler.lease_ttl_s=5", "cluster.name=rl-a"], environ=env)
    assert cfg.scheduler.lease_ttl_s == 5  # CLI beats env beats file
    assert cfg.scheduler.stop_deadline_s == 0.5  # file
    assert cfg.rollout.k == 6  # env
    assert cfg.trainer.lr == 0.01
    assert cfg.cluster.name == "rl-a"


def test_env_nesting_parses_scalars():
    tree = env_overrides({"TAILSPEC_ROLLOUT__CUDA_GRAPHS": "false", "TAILSPEC_TRAINER__LR": "1e-3", "OTHER": "x"})
    assert tree == {"rollout": {"cuda_graphs": False}, "trainer": {"lr": 1e-3}}


@pytest.mark.parametrize(
    "override, needle",
    [
        ("scheduler.lease_ttl_s=-1", "scheduler.lease_ttl_s"),
        ("scheduler.telemetry=cuda", "'auto', 'nvml' or 'simulated'"),
        ("scheduler.leas_ttl_s=1", "scheduler.leas_ttl_s: unknown key"),
        ("trainer.ttt_length=9", "trainer.ttt_length"),
        ("rollout.selector=magic", "rollout.selector"),
        ("cluster.name=bad name!", "cluster.name"),
    ],
)
def test_invalid_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override], environ={})
    assert needle in str(e.value)


def test_cross_field_check():
    with pytest.raises(ConfigError, match="weight_min"):
        load_config(overrides=["trainer.weight_min=6", "trainer.weight_max=2"], environ={})


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad, environ={})
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(overrides=["nokey"], environ={})


def test_cli_config_show(capsys):
    from tailspec.cli import main

    assert main(["config", "show", "--set", "rollout.k=3"]) == 0
    out = capsys.readouterr().out
    assert "k: 3" in out and "scheduler:" in out
    assert main(["config", "show", "--set", "rollout.k=99"]) == 2
    assert "rollout.k" in capsys.readouterr().err


def test_every_config_field_is_read_somewhere():
    """A key nothing reads is a setting that silently does nothing: every field of every section must be read
    (as `.field`) by the code outside core/config.py. A weak check for common names (`name`, `k`), a
    real one for the rest."""
    import re
    from pathlib import Path

    from tailspec.core.config import TailspecConfig

    root = Path(__file__).resolve().parents[1]
    config_py = root / "tailspec" / "core" / "config.py"
    src = "\n".join(p.read_text() for d in ("tailspec", "rollout", "scheduler", "drafter_trainer", "dashboards")
                    for p in (root / d).rglob("*.py") if p != config_py)
    unread = []
    for section, info in TailspecConfig.model_fields.items():
        fields = getattr(info.annotation, "model_fields", {section: None})
        for name in fields:
            if not re.search(rf"\.{name}\b", src):
                unread.append(f"{section}.{name}" if name != section else section)
    assert not unread, f"config fields nothing reads: {unread}"
