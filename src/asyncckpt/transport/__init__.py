"""Live recovery: a recovering worker fetches the training state from a healthy peer."""

from __future__ import annotations

from .base import CheckpointTransport, StepNotOffered
from .http import HTTPTransport
from .pg import PGTransport

__all__ = ["CheckpointTransport", "HTTPTransport", "PGTransport", "StepNotOffered"]
