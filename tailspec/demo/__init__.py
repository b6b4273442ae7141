"""The main job end to end: RL with long-tail rollouts on simulated GPUs, idle-GPU drafter co-training,
export. `tailspec demo` runs it; `tailspec bench e2e` runs it three ways side by side."""
