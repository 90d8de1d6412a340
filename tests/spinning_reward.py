"""A reward that never returns on some responses, in a module of its own: a reward process that
replaces a killed one imports only this (importing a test module would load torch each time)."""


def reward_that_spins_on_odd_lengths(response: str, truth: str) -> float:
    """Loops forever in pure Python (holding the GIL) on responses of odd length."""
    while len(response) % 2:
        pass
    return 1.0
