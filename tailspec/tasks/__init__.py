"""The built-in synthetic task (running-sum scratchpad) and the tiny-policy kit."""
