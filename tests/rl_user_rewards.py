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


# breaks_later: 0 until its call number BREAK_AT["at"], then NaN (None: never breaks)
BREAK_AT: dict = {"calls": 0, "at": None}


def breaks_later(prompts, completions, **kwargs):
    BREAK_AT["calls"] += 1
    broken = BREAK_AT["at"] is not None and BREAK_AT["calls"] >= BREAK_AT["at"]
    return [float("nan") if broken else 0.0] * len(completions)


def alternate_bools(prompts, completions, **kwargs):
    """TRL's common ``[c == a for ...]`` shape: bools, here True for every other completion."""
    return [i % 2 == 0 for i in range(len(completions))]


# exits_later: 0.0 until its call number EXIT_AT["at"], then sys.exit() (None: never)
EXIT_AT: dict = {"calls": 0, "at": None}


def exits_later(prompts, completions, **kwargs):
    import sys

    EXIT_AT["calls"] += 1
    if EXIT_AT["at"] is not None and EXIT_AT["calls"] >= EXIT_AT["at"]:
        sys.exit()
    return [0.0] * len(completions)
