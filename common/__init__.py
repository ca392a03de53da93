"""Shared pieces of wafl: wire codec, configuration, data, models, algorithms, logging."""
