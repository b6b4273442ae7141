"""The rollout's own drafter-training targets: each request's aux hidden states and the target's logits, kept as
the engine computes them, so a training session can skip the policy's forward over the sample (TLT ships its
rollout's hidden states the same way). On the deep miniature that forward is over half a session's step.

Positions, for a request of prompt length P that generated G tokens (sequence length n = P + G):
- aux states at positions 0..n-2, every position whose next token is in the sequence: the prefill writes
  0..P-2, each verify forward L-1..L-1+k;
- logits at positions P-1..n-2 (indexed by generated token 0..G-1): the raw distributions (no temperature)
  its G tokens were drawn from.
A verify writes all k+1 positions; those past the accepted drafts hold rejected drafts' states until the next
verify overwrites them, as the KV cache does, and a finished request is read only up to its length.

The logits are shipped as they are: the miniature's vocabulary (72) is smaller than its hidden size. At a real
vocabulary (150k ids) they would be ~12x the aux states; there the final hidden state should travel instead,
with the session applying the LM head (not built).
"""

from __future__ import annotations

import torch


class StateRecorder:
    """Per-slot buffers of aux states [slot, position, A] and logits [slot, generated token, V], moved with
    the engine's slots."""

    def __init__(self, max_slots: int, width: int, gen_width: int, aux_dim: int, vocab: int,
                 device: torch.device, dtype: torch.dtype):
        self.aux = torch.zeros(max_slots, width, aux_dim, dtype=dtype, device=device)
        self.logits = torch.zeros(max_slots, gen_width, vocab, dtype=torch.float32, device=device)

    def prefill(self, slot0: int, aux: torch.Tensor) -> None:
        """aux [rows, w, A] of slots slot0.. at positions 0..w-1."""
        self.aux[slot0 : slot0 + aux.shape[0], : aux.shape[1]] = aux

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor, upto: int | None = None) -> None:
        """`upto`: positions 0..upto-1 only (a request's generated count is below its length)."""
        self.aux[dst, :upto] = self.aux[src, :upto]
        self.logits[dst, :upto] = self.logits[src, :upto]

    def step(self, lengths: torch.Tensor, gen: torch.Tensor, aux: torch.Tensor, logits: torch.Tensor) -> None:
        """A verify of rows 0..n-1: aux [n, k+1, A] at positions L-1.., logits [n, k+1, V] of generated tokens
        gen.. (lengths and gen as before the step's tokens are emitted)."""
        n, w = aux.shape[:2]
        j = torch.arange(w, device=aux.device)
        pos = ((lengths - 1)[:, None] + j)[..., None]
        self.aux[:n].scatter_(1, pos.expand(n, w, aux.shape[-1]), aux.to(self.aux.dtype))
        at = (gen[:, None] + j)[..., None]
        self.logits[:n].scatter_(1, at.expand(n, w, logits.shape[-1]), logits.float())

    def take(self, slots: torch.Tensor, lengths: list[int], generated: list[int]
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(aux [n-1, A], logits [G, V]) on the host for each finished slot (one copy of each buffer)."""
        aux = self.aux[slots, : max(lengths) - 1].cpu()
        logits = self.logits[slots, : max(generated)].cpu()
        return [(aux[i, : n - 1].clone(), logits[i, :g].clone()) for i, (n, g) in enumerate(zip(lengths, generated))]
