"""Weight resharding from the training layout to the rollout layout: pure planner + transports (docs/design.md §4)."""
