"""Rollout engine backends: ``torch`` (the embedded engine); each registers in :data:`purerl.rollout.engine.ENGINES`."""
