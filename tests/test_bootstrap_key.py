"""The bootstrap drafter's cache key (tailspec.demo.bootstrap): it names what the offline run depends on, so a
setting only sessions read (the co-training lr beside a set bootstrap_lr) reuses the cached first drafter, while a
setting of the offline run itself trains a new one."""

from __future__ import annotations

from tailspec.core.config import TailspecConfig

from tailspec.demo.bootstrap import _key, bootstrap_trainer


def key(tmp_path, **trainer) -> str:
    cfg = TailspecConfig()
    for name, value in trainer.items():
        setattr(cfg.trainer, name, value)
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    return _key(tmp_path, cfg, 256, 600.0, 0, 166)


def test_the_co_training_lr_does_not_key_the_bootstrap(tmp_path):
    base = key(tmp_path, bootstrap_lr=6e-4, lr=2e-4)
    assert key(tmp_path, bootstrap_lr=6e-4, lr=6e-4) == base
    assert key(tmp_path, bootstrap_lr=3e-4, lr=2e-4) != base  # the offline run's own lr
    assert key(tmp_path, bootstrap_lr=6e-4, lr=2e-4, batch_size=4) != base
    assert key(tmp_path, lr=2e-4) != key(tmp_path, lr=6e-4)  # without bootstrap_lr the offline run trains at lr


def test_where_sessions_take_their_targets_does_not_key_the_bootstrap(tmp_path):
    assert key(tmp_path, target_source="teacher") == key(tmp_path, target_source="rollout")


def test_the_offline_run_trains_at_bootstrap_lr():
    cfg = TailspecConfig()
    cfg.trainer.lr, cfg.trainer.bootstrap_lr = 2e-4, 6e-4
    assert bootstrap_trainer(cfg).lr == 6e-4 and cfg.trainer.lr == 2e-4
    cfg.trainer.bootstrap_lr = None
    assert bootstrap_trainer(cfg).lr == 2e-4
