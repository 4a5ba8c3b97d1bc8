"""Data plane: task adapters (prompt source + verifier), chosen by name or ``module:Class``."""
