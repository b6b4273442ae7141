"""GPUs and models of a projection, and the roofline that turns them into step costs.

A decode step reads the weights once and every running row's KV cache, and does 2 FLOPs per active
parameter per token it scores; on a GPU it takes the larger of the two times (memory-bound at small
batches, compute-bound at large ones), divided by the tensor-parallel size, plus a fixed per-step cost
(launches, sampling) and, with tensor parallelism, two all-reduces per layer. Speculation scores k + 1
tokens per row in one verify forward and runs k forwards of the one-layer drafter before it. The result is
a `CostModel` table over the engine's own batch buckets and draft lengths: the selector that picks k
from it is the engine's (`tailspec.rollout.selector`), not a copy.

A speculative step also pays the sampler's passes over k + 1 positions' logits, the K/V writes of every
scored position, the drafter layer's attention over the context, an EAGLE proposer's first drafter forward
over the verified positions, and the host work a plain step hides behind the GPU (`Roofline`'s docstring:
each term, its size and its source). With every such term zero the plain roofline comes back.

Every figure is a projection; the presets' numbers are the vendors' published peaks (dense bf16) and the
models' published configs. The memory bandwidth a decode reaches is a share of the GPU's copy bandwidth: measured
on a lent GPU where BENCHMARKS.md has it (H100, H200), else the vendor peak times the share of peak those GPUs'
copies reached. `CONSTANTS` says of every constant whether it is measured or assumed, and where it comes from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from tailspec.rollout.cost_model import CostModel, default_buckets, default_ks


@dataclass(frozen=True)
class GpuSpec:
    name: str
    hbm_tb_s: float  # HBM bandwidth, TB/s (vendor peak)
    bf16_tflops: float  # dense bf16 peak, TFLOP/s
    memory_gb: float
    copy_tb_s: float | None = None  # device copy bandwidth measured on a lent GPU (BENCHMARKS.md, On a GPU)

    @property
    def copy_bandwidth_tb_s(self) -> float:
        """The measured copy bandwidth, else the peak times the share of peak the measured GPUs' copies reached."""
        return self.copy_tb_s if self.copy_tb_s is not None else self.hbm_tb_s * measured_copy_share()


GPUS: dict[str, GpuSpec] = {
    # H100 SXM5; copy 2,954 GB/s (BENCHMARKS.md, On a GPU: the HBM floor, H100 first lease)
    "H100": GpuSpec("H100", 3.35, 989.0, 80.0, copy_tb_s=2.954),
    # copy 4,184 and 4,135 GB/s (the HBM floor, H200 second and third leases): their mean
    "H200": GpuSpec("H200", 4.8, 989.0, 141.0, copy_tb_s=4.16),
    "B200": GpuSpec("B200", 8.0, 2250.0, 192.0),
    "GB200": GpuSpec("GB200", 8.0, 2500.0, 186.0),  # one Blackwell GPU of a GB200 superchip
    "GH200": GpuSpec("GH200", 4.0, 989.0, 96.0),  # the Hopper GPU of a GH200 superchip, 96 GB HBM3
}


def measured_copy_share() -> float:
    """Copy bandwidth ÷ vendor peak, the mean over the GPUs a lease measured."""
    shares = [g.copy_tb_s / g.hbm_tb_s for g in GPUS.values() if g.copy_tb_s is not None]
    return sum(shares) / len(shares)


# Every constant of the hardware model: whether a lent GPU measured it, and the source.
CONSTANTS: dict[str, tuple[str, str]] = {
    **{f"{g.name}.copy_bandwidth": ("measured", "BENCHMARKS.md On a GPU, the HBM floor") for g in GPUS.values()
       if g.copy_tb_s is not None},
    **{f"{g.name}.copy_bandwidth": ("assumed", "vendor peak x the measured GPUs' copy share")
       for g in GPUS.values() if g.copy_tb_s is None},
    "peak_bandwidth_and_flops": ("assumed", "vendors' published peaks (dense bf16)"),
    "bandwidth_efficiency": ("assumed", ("decode's bandwidth / copy bandwidth, 0.8 (vLLM-class engines reach 0.6-0.8 "
                                         "of peak; none measured on a lent GPU at a size where decode is memory-bound)")),
    "flops_efficiency": ("assumed", "0.5 of peak in a compute-bound forward"),
    "step_overhead_s": ("assumed", ("0.5 ms per decode step with CUDA graphs; the lent GPUs timed the native engine's "
                                    "replayed verify of the 20-layer deep preset at 1.6 ms (b 1), 3.3-7.0x faster "
                                    "than eager: a launch-bound toy, which bounds no real model's overhead")),
    "draft_overhead_s": ("assumed", ("0.1 ms per captured drafter forward; the native engine's eager drafter "
                                     "measured 0.7-0.8 ms a drafted token on a lent GPU (not captured, so not this "
                                     "term)")),
    "spec_host_s": ("assumed", "vLLM PR 25872: 0.97 ms a speculative step"),
    "allreduce_s": ("assumed", "10 us per all-reduce"),
    "train_mfu": ("assumed", "0.4 of peak for the RL update"),
    "drafter_mfu": ("assumed", "0.3 of peak for drafter training"),
    "session_startup": ("assumed", "weights at 8 GB/s + 1 s"),
    "weight_sync": ("assumed", "weights at 100 GB/s + 0.5 s"),
}


def constants() -> dict[str, str]:
    """{name: "measured" | "assumed"} of `CONSTANTS`."""
    return {k: status for k, (status, _) in CONSTANTS.items()}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params_b: float  # total parameters, billions
    active_b: float  # parameters a token passes through (MoE: shared + routed experts), billions
    experts: int = 0  # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0
    expert_params_b: float = 0.0  # all routed experts' parameters, billions

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * 2  # bf16

    @property
    def kv_bytes_per_token(self) -> float:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2

    def weight_bytes_read(self, tokens: float) -> float:
        """Bytes of weights one forward over `tokens` tokens reads: all of a dense model; for an MoE, the
        dense part plus the routed experts at least one token picked (uniform routing)."""
        if not self.experts:
            return self.weight_bytes
        dense = (self.params_b - self.expert_params_b) * 1e9 * 2
        touched = 1.0 - (1.0 - self.experts_per_token / self.experts) ** max(tokens, 1.0)
        return dense + self.expert_params_b * 1e9 * 2 * touched

    def flops_per_token(self, context: float) -> float:
        """Forward FLOPs of one token: 2 per active parameter plus attention over `context` positions."""
        return 2 * self.active_b * 1e9 + 4 * self.layers * self.heads * self.head_dim * context

    @property
    def drafter_params(self) -> float:
        """An EAGLE-3 drafter for this model: fc over three hidden states, one decoder layer whose q/k/v take
        2 x hidden, an MLP of 3 x hidden x 4 hidden, and a 32k-token draft vocabulary head."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attn = 2 * h * (self.heads * self.head_dim) + 2 * 2 * h * kv + self.heads * self.head_dim * h
        return 3 * h * h + attn + 3 * h * 4 * h + min(self.vocab, 32_000) * h


MODELS: dict[str, ModelSpec] = {
    # Qwen2.5-7B config.json: 28 layers, hidden 3584, 28 heads, 4 KV heads, vocab 152064, 7.6B params
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 128, 152_064, 7.62, 7.62),
    # Qwen3-8B: 36 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128, 8.2B params
    "qwen3-8b": ModelSpec("qwen3-8b", 36, 4096, 32, 8, 128, 151_936, 8.19, 8.19),
    # Qwen3-32B: 64 layers, hidden 5120, 64 heads, 8 KV heads, head_dim 128, 32.8B params
    "qwen3-32b": ModelSpec("qwen3-32b", 64, 5120, 64, 8, 128, 151_936, 32.8, 32.8),
    # Qwen3-235B-A22B: 94 layers, hidden 4096, 64 heads, 4 KV heads, 128 experts (8 per token) of
    # intermediate 1536: 3 x 4096 x 1536 x 128 x 94 = 227B of routed experts, 22B active
    "qwen3-235b-a22b": ModelSpec("qwen3-235b-a22b", 94, 4096, 64, 4, 128, 151_936, 235.0, 22.0,
                                 experts=128, experts_per_token=8, expert_params_b=227.0),
}


def model_from_hf_config(path: str | Path) -> ModelSpec:
    """A ModelSpec from a Hugging Face `config.json` (a file or the directory holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        c = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read a model config from {p}: {e}") from e
    return model_from_config(c, p.parent.name or "custom", str(p))


def model_from_config(c: dict, name: str = "custom", where: str = "config") -> ModelSpec:
    """A ModelSpec from a Hugging Face config's fields."""
    try:
        layers, h, heads = int(c["num_hidden_layers"]), int(c["hidden_size"]), int(c["num_attention_heads"])
        vocab, inter = int(c["vocab_size"]), int(c.get("intermediate_size", 4 * h))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: not a decoder config (missing or bad {e})") from e
    kv = int(c.get("num_key_value_heads", heads))
    hd = int(c.get("head_dim") or h // heads)
    attn = h * heads * hd * 2 + 2 * h * kv * hd
    experts, per_tok = int(c.get("num_experts", c.get("num_local_experts", 0)) or 0), int(c.get("num_experts_per_tok", 0) or 0)
    tied = bool(c.get("tie_word_embeddings", False))
    emb = vocab * h * (1 if tied else 2)
    if experts:
        moe_inter = int(c.get("moe_intermediate_size", inter))
        expert_total = 3 * h * moe_inter * experts * layers
        total = layers * attn + expert_total + emb
        active = layers * (attn + 3 * h * moe_inter * per_tok) + emb
        return ModelSpec(name, layers, h, heads, kv, hd, vocab, total / 1e9, active / 1e9,
                         experts, per_tok, expert_total / 1e9)
    total = layers * (attn + 3 * h * inter) + emb
    return ModelSpec(name, layers, h, heads, kv, hd, vocab, total / 1e9, total / 1e9)


def resolve_model(name: str) -> ModelSpec:
    if name in MODELS:
        return MODELS[name]
    if Path(name).exists():
        return model_from_hf_config(name)
    raise ValueError(f"unknown model {name!r}: choose {', '.join(MODELS)} or a path to a config.json")


def resolve_gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name.upper()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}: choose {', '.join(GPUS)}") from None


@dataclass(frozen=True)
class Roofline:
    """Step costs of one replica (`tp` GPUs) of `model` on `gpu`.

    Beyond the weights, KV reads and FLOPs of the forwards, a step pays what a speculative engine adds (each
    term a byte count from the model's shapes, at the same bandwidth; zero them all and a step costs what the
    plain roofline said):
    - `sampler_bytes_per_logit`: every scored position's logits over the vocabulary, fp32, written by the
      lm_head (4 B), read and written once by the softmax into probabilities (8 B) and read by the sampler or
      the rejection sampler (4 B): 16 B per logit. A plain step scores b positions, a verify b (k + 1) over
      the target's vocabulary, and the k drafter forwards b each over the draft vocabulary (the rejection
      sampler needs the draft probabilities too).
    - `kv_write_share`: the K/V of every scored position written to the cache (rejected drafts' included),
      in units of a token's KV bytes: the target's over all its layers, the drafter's over its one layer.
    - `drafter_attention`: the drafter's layer attends over the whole context each forward: it reads its own
      layer's K/V (and does the attention FLOPs) over it, like one more layer of the target.
    - `draft_rescore`: an EAGLE proposer's first drafter forward of a step runs over every position the
      verify scored (k + 1 per row, to put the accepted tokens' features into the drafter's cache), the next
      k - 1 over one token per row (this matters only where the drafter is compute-bound).
    - `draft_overhead_s`: the launches and host work of one drafter forward (with CUDA graphs).
    - `spec_host_s`: the host's per-step work (scheduling, inputs for k + 1 positions per row, acceptance
      bookkeeping) that a plain step hides behind the GPU with asynchronous scheduling and a speculative step
      does not: vLLM refused async scheduling with speculative decoding (PR 19970) until 0.14 (PR 31998), and
      its first support overlaps that work only with drafting, not with the verify (PR 24799). Default 0.97
      ms: what overlapping it saved per step in vLLM PR 25872 (Llama-3.1-8B + EAGLE-3, k = 4, concurrency 1,
      L20: mean inter-token latency 28.14 -> 27.17 ms). 0 for an engine that overlaps it.
    """

    model: ModelSpec
    gpu: GpuSpec
    tp: int = 1
    bandwidth_efficiency: float = 0.8  # decode's bandwidth / the GPU's copy bandwidth (assumed: CONSTANTS)
    flops_efficiency: float = 0.5  # achieved / peak FLOPs in a compute-bound forward
    step_overhead_s: float = 0.5e-3  # launches, sampling, scheduling per decode step (with CUDA graphs)
    draft_overhead_s: float = 0.1e-3  # the same per drafter forward
    allreduce_s: float = 10e-6  # one all-reduce's latency with tensor parallelism (two per layer)
    sampler_bytes_per_logit: float = 16.0  # fp32 logits: lm_head write 4 + softmax read/write 8 + sampler read 4
    kv_write_share: float = 1.0  # K/V written per scored position, in a token's KV bytes
    drafter_attention: float = 1.0  # share of the context the drafter layer attends over per forward (reads + FLOPs)
    draft_rescore: bool = True  # the first drafter forward of a step over the k + 1 verified positions per row
    spec_host_s: float = 0.97e-3  # host work per speculative step not overlapped with the GPU (vLLM PR 25872)
    draft_vocab: int = 32_000  # an EAGLE-3 drafter's draft vocabulary (SpecForge / vLLM default)

    def __post_init__(self) -> None:
        if self.tp < 1 or not 0 < self.bandwidth_efficiency <= 1 or not 0 < self.flops_efficiency <= 1:
            raise ValueError(f"need tp >= 1 and efficiencies in (0, 1], got tp={self.tp}, "
                             f"{self.bandwidth_efficiency}, {self.flops_efficiency}")
        if min(self.sampler_bytes_per_logit, self.kv_write_share, self.drafter_attention, self.spec_host_s) < 0:
            raise ValueError("speculation cost terms must be >= 0")

    @property
    def bandwidth_bytes_s(self) -> float:
        """The bandwidth a decode forward reaches, bytes/s: the copy bandwidth x `bandwidth_efficiency`."""
        return self.gpu.copy_bandwidth_tb_s * 1e12 * self.bandwidth_efficiency

    def _forward(self, bytes_: float, flops: float) -> float:
        bw = self.bandwidth_bytes_s
        peak = self.gpu.bf16_tflops * 1e12 * self.flops_efficiency
        comm = 2 * self.model.layers * self.allreduce_s if self.tp > 1 else 0.0
        return max(bytes_ / bw, flops / peak) / self.tp + comm

    def verify_s(self, batch: int, k: int, context: float) -> float:
        """One target forward scoring k + 1 tokens for each of `batch` rows at mean context `context`, its
        K/V writes and the sampler's passes over its logits."""
        m = self.model
        tokens = batch * (k + 1)
        bytes_ = (m.weight_bytes_read(tokens) + batch * context * m.kv_bytes_per_token
                  + tokens * (self.kv_write_share * m.kv_bytes_per_token + self.sampler_bytes_per_logit * m.vocab))
        return self._forward(bytes_, tokens * m.flops_per_token(context)) + self.step_overhead_s

    @property
    def drafter_kv_bytes_per_token(self) -> float:
        """K and V of the drafter's one layer (the target's KV heads and head size), bf16."""
        return 2 * self.model.kv_heads * self.model.head_dim * 2

    def draft_s(self, batch: int, context: float = 0.0, tokens_per_row: int = 1) -> float:
        """One drafter forward over `tokens_per_row` tokens per row at mean context `context`; the drafter runs
        on every GPU of the replica's TP group (not sharded), so its time is one GPU's."""
        p, m = self.model.drafter_params, self.model
        tokens = batch * tokens_per_row
        kv = self.drafter_kv_bytes_per_token
        seen = context * self.drafter_attention
        bytes_ = (p * 2 + batch * seen * kv
                  + tokens * (self.kv_write_share * kv + self.sampler_bytes_per_logit * min(m.vocab, self.draft_vocab)))
        flops = tokens * (2 * p + 4 * m.heads * m.head_dim * seen)
        return self._forward(bytes_ * self.tp, flops * self.tp) + self.draft_overhead_s

    def step_s(self, batch: int, k: int, context: float) -> float:
        if k == 0:
            return self.verify_s(batch, 0, context)
        first = self.draft_s(batch, context, k + 1 if self.draft_rescore else 1)
        return self.verify_s(batch, k, context) + first + (k - 1) * self.draft_s(batch, context) + self.spec_host_s

    def cost_model(self, max_batch: int, k_max: int, context: float) -> CostModel:
        """The t(b, k) table the engine would measure at warm-up, over its own buckets and strategies."""
        buckets, ks = default_buckets(max_batch), default_ks(k_max)
        table = {(b, k): self.step_s(b, k, context) for b in buckets for k in ks}
        return CostModel(buckets, ks, table)

    def prefill_s(self, requests: int, prompt_len: int) -> float:
        """Prefill of `requests` prompts in one chunked pass (compute-bound for any real prompt)."""
        tokens = requests * prompt_len
        return self._forward(self.model.weight_bytes_read(tokens), tokens * self.model.flops_per_token(prompt_len / 2))

    def with_tp(self, tp: int) -> Roofline:
        return replace(self, tp=tp)


def train_step_s(model: ModelSpec, gpu: GpuSpec, gpus: int, tokens: float, mfu: float = 0.4,
                 flops_per_param_token: float = 10.0) -> float:
    """The RL update on `gpus` GPUs: old-policy and reference forwards (2 + 2) and the policy's forward and
    backward (6) FLOPs per active parameter per token, at model FLOPs utilisation `mfu`."""
    if gpus < 1 or not 0 < mfu <= 1:
        raise ValueError(f"need gpus >= 1 and 0 < mfu <= 1, got {gpus}, {mfu}")
    return flops_per_param_token * model.active_b * 1e9 * tokens / (gpus * gpu.bf16_tflops * 1e12 * mfu)


def drafter_tokens_per_s(model: ModelSpec, gpu: GpuSpec, tp: int, mfu: float = 0.3, ttt_length: int = 3) -> float:
    """Drafter training throughput of one lent replica: a teacher forward of the policy (2 FLOPs per active
    parameter per token) and `ttt_length` unrolled drafter forward + backward passes (6 per drafter
    parameter each), at `mfu`."""
    flops = 2 * model.active_b * 1e9 + ttt_length * 6 * model.drafter_params
    return tp * gpu.bf16_tflops * 1e12 * mfu / flops


def validation_s(model: ModelSpec, gpu: GpuSpec, tp: int, tokens: float, mfu: float = 0.3, k: int = 4) -> float:
    """One candidate's paired validation on a lent replica (drafter_trainer/validation.py): a teacher forward
    over `tokens` held-out tokens (2 FLOPs per active parameter each) and k-step forward unrolls of two drafters,
    the candidate and the current version (2 per drafter parameter each), at `mfu`."""
    flops = tokens * (2 * model.active_b * 1e9 + 2 * k * 2 * model.drafter_params)
    return flops / (tp * gpu.bf16_tflops * 1e12 * mfu)


def session_startup_s(model: ModelSpec, tp: int, load_gb_s: float = 8.0, fixed_s: float = 1.0) -> float:
    """A lent replica's session start: the teacher's weights (its TP shard per GPU) from host memory or local
    disk at `load_gb_s`, plus a fixed cost (CUDA context in a pre-started process, drafter and optimizer)."""
    return model.weight_bytes / tp / (load_gb_s * 1e9) + fixed_s


def weight_sync_s(model: ModelSpec, gb_s: float = 100.0, fixed_s: float = 0.5) -> float:
    """Trainer → rollout weight broadcast after the update."""
    return model.weight_bytes / (gb_s * 1e9) + fixed_s


def min_tp(model: ModelSpec, gpu: GpuSpec, kv_share: float = 0.35) -> int:
    """The smallest power-of-two TP size whose shards leave `kv_share` of each GPU's memory for the KV cache."""
    tp = 1
    while model.weight_bytes / tp > gpu.memory_gb * 1e9 * (1 - kv_share):
        tp *= 2
        if tp > 64:
            raise ValueError(f"{model.name} does not fit on {gpu.name} with tp <= 64")
    return tp
