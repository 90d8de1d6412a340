"""Rollout engine backends: ``torch`` (the embedded engine) and ``vllm``; each is the factory of a kind of engine
in :data:`purerl.rollout.engines.ENGINES`, imported when the first engine of that kind is built."""
