"""Per-worker rollout progress from inside a Hugging Face `generate` call, at every decoding step.

`FinishedCounter` is a forward pre-hook on the generating model (a PyTorch hook: nothing of the model or of
`generate` is replaced). With a KV cache each decoding step feeds the tokens sampled at the previous step; a
row whose newest token is EOS or padding has finished (`generate` pads a finished row until the batch is done),
so at each step the hook knows how many sequences finished without keeping any state of its own. The first
call of a `generate` is the prefill: the prompt's last token, which with left padding is never padding.

The count is sent at most every `every_s` (reading the tokens syncs an accelerator; the rest of the steps
cost one clock read), through a callback that must not block (the client's `report_progress` only updates a
buffer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch


class FinishedCounter:
    def __init__(self, report: Callable[[int, int, int], None], stop_ids: Iterable[int], every_s: float = 0.05):
        """`report(active, finished, total)` is called while sequences decode (and once at `close`)."""
        self.report = report
        self.stop_ids = sorted({int(i) for i in stop_ids})
        if not self.stop_ids:
            raise ValueError("FinishedCounter needs at least one EOS / padding id")
        self.every_s = every_s
        self.total = self.finished = self.steps = 0
        self.seconds = 0.0  # time spent in the hook, reports included
        self._stop: torch.Tensor | None = None
        self._last = float("-inf")
        self._handle: Any = None

    def attach(self, model: torch.nn.Module) -> FinishedCounter:
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> FinishedCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        t0 = time.perf_counter()
        try:
            self._count(args, kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    def _count(self, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return
        self.steps += 1
        if self.steps == 1:  # the prefill: a new batch
            self.total = ids.shape[0]
            self.report(self.total, 0, self.total)
            self._last = time.monotonic()
            return
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        if self._stop is None or self._stop.device != ids.device:
            self._stop = torch.tensor(self.stop_ids, device=ids.device)
        self.finished = int(torch.isin(ids[:, -1], self._stop).sum())
        self.report(self.total - self.finished, self.finished, self.total)
