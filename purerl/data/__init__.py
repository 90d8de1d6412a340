"""Prompts and ground truths: procedural math problems, verl-format files, the data cursor."""
