"""The host runtime: launchers, launch-time caches, the L2 window, device queries, the mode state."""
