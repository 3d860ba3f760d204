"""Crowdtrain backbone aggregator: holds parameter slices, takes gradient uploads, steps when the site commits."""

from __future__ import annotations

from .config import BackboneConfig, ConfigError, load_config
from .server import BackboneServer, run

__all__ = ["BackboneConfig", "BackboneServer", "ConfigError", "load_config", "run"]
