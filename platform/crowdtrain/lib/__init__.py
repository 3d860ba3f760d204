"""Helpers that belong to no app: code every part of the site may use, which imports none of the apps."""
