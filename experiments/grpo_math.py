"""GRPO on math word problems (placeholder until the end-to-end issue lands)."""

raise SystemExit("experiments/grpo_math.py: the end-to-end GRPO job is not built yet")
