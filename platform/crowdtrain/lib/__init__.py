"""Helpers that belong to no app: metric definitions, the off-loop runner, patches on library internals.

Everything here sits below every app: a module of ``crowdtrain.lib`` imports no app
(``tests/test_architecture.py`` holds it to that).
"""
