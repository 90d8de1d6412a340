"""Shared fixtures for unit and integration tests (tiny models, temp run folders)."""

import torch

torch.use_deterministic_algorithms(True)
