"""Benchmarks of wafl (run each as ``python benchmarks/<name>.py`` from the repository root)."""
