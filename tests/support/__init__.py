"""Shared harnesses of the tests (imported as ``support.<module>``; nothing here is collected)."""
