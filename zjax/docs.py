"""``python -m zjax.docs``: print the generated config reference (pasted into the README)."""

from zjax._docs import config_reference

if __name__ == "__main__":
    print(config_reference())
