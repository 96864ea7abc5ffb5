"""Worked examples for contributors (``docs/extending.md``): a new data kind and a new backend.

They live under ``tests/`` so that every CI run type-checks them (mypy --strict) and runs
their tests; the guide quotes them, so the guide cannot drift from code that works.
"""
