"""One manager per data kind, each a short composition of the layers below.

A manager names its pool, its pipeline, its backend and its policy, and owns no threads
of its own. Imports only the layers below it; never SGLang.
"""
