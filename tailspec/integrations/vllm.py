"""vLLM rollouts that follow promotions: turning a promoted drafter version into what vLLM loads.

`rollout.vllm_live.LiveVllm` reads `drafter:current` before each generation call; the record names a version
directory in tailspec's drafter format (`drafter_trainer.versions`), which vLLM cannot read. `export_version`
is the `prepare` hook that exports it once as an EAGLE-3 directory (`drafter_trainer.export`) beside the
version, and serves it from there on:

    from tailspec.integrations.vllm import export_version
    live = LiveVllm(ro, redis=r, cluster="prod", prepare=export_version)
"""

from __future__ import annotations

from pathlib import Path

from tailspec.core.state import DrafterVersion
from tailspec.drafter_trainer.export import export
from tailspec.drafter_trainer.model import Eagle3Module
from tailspec.rollout.vllm_checks import DrafterMismatch
from tailspec.rollout.vllm_live import servable_dir


def export_version(info: DrafterVersion, out_root: str | Path | None = None, dtype: str = "float32") -> Path:
    """The EAGLE-3 export of version `info`: `<out_root or the version's parent>/v<N>-eagle3`, written once
    (whole or absent: the exporter writes a temporary sibling and renames it) and reused after. A version
    that already is an EAGLE-3 export is returned as is."""
    src = Path(info.path)
    try:
        return servable_dir(info)
    except DrafterMismatch:
        pass
    out = Path(out_root) if out_root is not None else src.parent
    dst = out / f"v{info.version:05d}-eagle3"
    if not (dst / "config.json").is_file():
        export(Eagle3Module.load(src), dst, "eagle3", dtype=dtype)
    return dst
