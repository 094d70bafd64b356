"""Choosing a run's training objective and building its trainer (fastlm/training/registry.py)."""
