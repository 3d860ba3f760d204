"""Crowdtrain agent: trains a campaign's model on a volunteer's GPU or CPU."""

from __future__ import annotations

__version__ = "0.1.0"
