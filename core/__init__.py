"""The floor every part of tailspec stands on: configuration (`config`), the cluster-state schema and its Redis
key table (`state`), and crash-safe file writes (`atomic`). It imports no component and nothing of the roof,
so a component can import it without pulling in another (docs/architecture.md, "Import arrows")."""
