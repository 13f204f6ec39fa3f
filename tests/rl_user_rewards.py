"""Reward functions a user would bring (TRL's signature), good and broken, for tests."""


def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def only_some(prompts, completions, answer, **kwargs):
    return [None if a is None else 1.0 for a in answer]


def raises(prompts, completions, **kwargs):
    raise KeyError("answer")


def short_list(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def nan_reward(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)


def text_reward(prompts, completions, **kwargs):
    return ["1"] * len(completions)
