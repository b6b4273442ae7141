"""The run's drafter at its end, exported for serving: an EAGLE-3 directory (vLLM, SGLang) and an HF directory."""

from __future__ import annotations

import logging
from pathlib import Path

from tailspec.drafter_trainer.export import ExportError, export
from tailspec.drafter_trainer.model import Eagle3Module

log = logging.getLogger("tailspec.demo")


def export_run_drafter(model, path: str, version: int, policy_version: int, run_dir: Path
                       ) -> tuple[dict[str, str], dict[str, str]]:
    """Export the drafter at `path` (version `version`, over `model`'s embedding) into RUN_DIR/export/<format>;
    returns ({format: directory}, {format: why it was skipped})."""
    drafter = Eagle3Module.load(path, model.get_input_embeddings())
    meta = {"drafter_version": version, "policy_version": policy_version, "run": str(run_dir)}
    exported, errors = {}, {}
    for fmt in ("eagle3", "hf"):
        try:
            export(drafter, run_dir / "export" / fmt, fmt=fmt, meta=meta)
            exported[fmt] = str(run_dir / "export" / fmt)
        except ExportError as e:  # e.g. a 2-layer target has no servable aux layer ids
            errors[fmt] = str(e)
            log.warning("export %s skipped: %s", fmt, e)
    return exported, errors
