"""Helpers shared by the test suites (importable as ``support``; see pytest's pythonpath)."""
