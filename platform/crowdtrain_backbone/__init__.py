"""Crowdtrain backbone aggregator: holds parameter slices, takes gradient uploads, steps when the site commits.

Entry points: ``python -m crowdtrain_backbone`` (see ``__main__``), ``server.run`` and
``server.BackboneServer`` for launchers and tests. Importing the package loads nothing
heavy, so a bad config fails before torch is imported.
"""
