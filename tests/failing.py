"""A reward function that fails at run time, for the failure-propagation test."""


def exploding_reward(response: str, row: dict) -> float:
    raise RuntimeError(f"boom on row {row.get('prompt')!r}")
