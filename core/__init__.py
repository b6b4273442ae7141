"""The floor every part of tailspec stands on: configuration (`config`), the cluster-state schema and its Redis
key table (`state`), crash-safe file writes (`atomic`), and host work at a low priority (`niceness`). It imports
no component and nothing of the roof, so a component can import it without pulling in another
(docs/architecture.md, "Import arrows")."""
