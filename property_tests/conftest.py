"""Hypothesis settings for the maths properties: deterministic, float64, bounded run time."""

import os

import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    max_examples=int(os.environ.get("PURERL_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("default")
torch.use_deterministic_algorithms(True)
