"""`tailspec simulate`: a discrete-event projection of RL steps on a GPU cluster (docs/architecture.md).

Every figure it prints is labelled "projection": it is computed from a roofline of the GPU, a model of the
drafter's acceptance and the scheduler's own idle state machine, not measured.
"""
