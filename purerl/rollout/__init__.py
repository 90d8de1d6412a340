"""Rollout: generating responses (an effect) behind one engine interface."""
