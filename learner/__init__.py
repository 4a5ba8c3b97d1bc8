"""Learning plane: GRPO, the staleness-bounded rollout buffer, leases, checkpoints."""
