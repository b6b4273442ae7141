"""The task's rollout samples: a policy's sampled responses to the built-in task's prompts with their exact
rewards, the input of `tailspec train --samples task:N`, the trainer bench and the tests (cached as JSON beside
the policy)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tailspec.core.state import Sample
from tailspec.tasks.runsum import grade, sample_problems


def generate_task_samples(policy_dir: str | Path, n: int, seed: int = 0, temperature: float = 1.0,
                          max_new_tokens: int | None = None) -> list[Sample]:
    """n rollout samples of a policy on the built-in task (prompts, sampled responses, exact rewards).
    `max_new_tokens` caps the responses (a capped response is a prefix of a policy sample: still right
    for distillation; its reward is that of the unfinished text, 0)."""
    # deferred: the CLI imports this module to build its parser (`tailspec --help` loads no torch)
    from tailspec.tasks.policy import generate_responses, load_policy
    from tailspec.tasks.tokenizer import decode_response, encode_prompt

    model, tok = load_policy(policy_dir)
    problems = sample_problems(n, seed=10_000 + seed)
    prompts = [encode_prompt(tok, p.prompt) for p in problems]
    max_new = max(len(p.gold) for p in problems) + 16
    if max_new_tokens is not None:
        max_new = min(max_new, max_new_tokens)
    responses = generate_responses(model, tok, prompts, max_new, temperature=temperature, seed=seed)
    return [
        Sample(prompt_ids=pr, response_ids=r, reward=grade(p, decode_response(tok, r)).reward, policy_version=0,
               group_id=f"{seed}-{i // 4}", ts=0.0)
        for i, (p, pr, r) in enumerate(zip(problems, prompts, responses))
    ]


def policy_samples(preset: str, n: int, seed: int = 0, temperature: float = 1.0,
                   max_new_tokens: int | None = None) -> tuple[Path, list[Sample]]:
    """(policy dir, n rollout samples of the task policy), cached as JSON beside the policy."""
    # deferred: the CLI imports this module to build its parser (`tailspec --help` loads no torch)
    from tailspec.tasks.policy import get_policy

    path = get_policy(preset, progress=False)
    cap = f"-m{max_new_tokens}" if max_new_tokens else ""
    cache = path.parent.parent / "samples" / f"{path.name}-n{n}-s{seed}-t{temperature}{cap}.json"
    if cache.is_file():
        return path, [Sample.model_validate(x) for x in json.loads(cache.read_text())]
    samples = generate_task_samples(path, n, seed, temperature, max_new_tokens)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps([s.model_dump(mode="json") for s in samples]))
    os.replace(tmp, cache)
    return path, samples
