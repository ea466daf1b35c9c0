"""One file a model family: its names, config keys and checkpoint spelling (family.py)."""
