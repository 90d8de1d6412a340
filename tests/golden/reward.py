"""The golden runs' reward: the fraction of a response's characters that are digits. A random
tiny model writes some digits by chance, so scores vary within a group and every stage of a step
has work to do (the math rewards score nearly every random response 0)."""


def digit_fraction(response: str, ground_truth: str) -> float:
    return sum(c.isdigit() for c in response) / max(len(response), 1)
