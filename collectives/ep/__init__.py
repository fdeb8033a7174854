"""EPBuffer's insides (``collectives/ep_buffer.py`` is the facade users import): the config, the context, the
planner that chooses one normal-mode and one low-latency path per buffer, the paths, and what they share
(agreement, checks, handles, message layouts, row moves and fixed-order sums). See ARCHITECTURE.md."""
