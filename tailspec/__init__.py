"""tailspec: lend the GPUs that RL rollouts' long tail leaves idle to speculative-decoding drafter
training, and roll out with an adaptive, lossless speculative engine."""

__version__ = "0.1.0"
