"""Weight resharding from the training layout to the rollout layout: pure planner + transports (DESIGN.md section 6)."""
