"""EAGLE-3 drafter, samples, reward-weighted distillation, sessions, versions, export. Knows models and samples — not GPU states."""
