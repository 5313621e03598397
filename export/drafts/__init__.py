"""The draft models export can put in a bundle: a truncated copy of the target, and the
feature draft (one layer on the target's features)."""
