"""Helpers that belong to no app: metrics, the off-loop runner, patches, JSON bodies, daphne's start-up.

Everything here sits below every app: a module of ``crowdtrain.lib`` imports no app
(``tests/test_site_layers.py`` holds it to that).
"""
