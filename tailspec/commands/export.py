"""`tailspec export`: write a drafter version as an EAGLE-3 directory (vLLM, SGLang) or an HF directory."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tailspec.commands.args import add_config_args, config_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a trained drafter (eagle3 for vLLM/SGLang, or hf)")
    p.add_argument("--format", choices=["eagle3", "hf"], default="eagle3")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (written whole or not at all)")
    p.add_argument("--version", type=int, default=None, help="drafter version (default: the promoted one)")
    p.add_argument("--from", dest="source", metavar="DIR",
                   help="a drafter checkpoint directory instead of a version (e.g. .../checkpoints/ckpt-00000300)")
    p.add_argument("--versions-dir", metavar="DIR", help="version store (default trainer.checkpoint_dir/versions)")
    p.add_argument("--policy", metavar="DIR", help="the target policy: checks the drafter fits it; needed by --format hf "
                                                   "(which carries the target's embedding)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    add_config_args(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    from tailspec.drafter_trainer.export import ExportError, export
    from tailspec.drafter_trainer.model import Eagle3Module
    from tailspec.drafter_trainer.versions import VersionStore

    cfg = config_from_args(args)
    out = Path(args.out)
    if out.exists() and not args.force:
        print(f"tailspec export: {out} exists (use --force to replace it)", file=sys.stderr)
        return 2
    embedding = None
    target_config = None
    if args.policy:
        # deferred: the CLI imports every command module to build its parser; this loads when the command runs
        from transformers import AutoConfig, AutoModelForCausalLM

        target_config = AutoConfig.from_pretrained(args.policy)
        if args.format == "hf":
            embedding = AutoModelForCausalLM.from_pretrained(args.policy).get_input_embeddings()
    elif args.format == "hf":
        print("tailspec export: --format hf carries the target's embedding: give --policy DIR", file=sys.stderr)
        return 2
    meta = {}
    try:
        if args.source:
            drafter = Eagle3Module.load(args.source, embedding)
            meta["source"] = str(Path(args.source).resolve())
        else:
            store = VersionStore(args.versions_dir or Path(cfg.trainer.checkpoint_dir) / "versions")
            drafter, info = store.load(args.version, embedding)
            meta["version"] = info.model_dump(mode="json")
    except (FileNotFoundError, ValueError) as e:
        print(f"tailspec export: {e}", file=sys.stderr)
        return 2
    if target_config is not None:
        problems = drafter.fits(target_config)
        if problems:
            print("tailspec export: the drafter does not fit the policy: " + "; ".join(problems), file=sys.stderr)
            return 2
    try:
        path = export(drafter, out, args.format, args.dtype, meta=meta)
    except ExportError as e:
        print(f"tailspec export: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"format": args.format, "out": str(path), **({"version": meta["version"]["version"]}
                                                                   if "version" in meta else {})}))
    return 0
