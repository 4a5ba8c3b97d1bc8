"""Rollout plane: inference backends and sampling with per-token behaviour log-probabilities."""
