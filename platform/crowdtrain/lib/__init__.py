"""Helpers that belong to no app: the site's settings loader, text, SQL and metric plumbing.

Everything here sits below every app: a module of ``crowdtrain.lib`` imports no app
(``tests/test_architecture.py`` holds it to that).
"""
