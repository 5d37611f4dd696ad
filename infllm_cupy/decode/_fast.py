"""The decode launchers' prepared launches: `_launch.Launches` and `_launch.Program` (one launch path
for the whole package)."""
from __future__ import annotations

from .._launch import Launches, Program

__all__ = ["Launches", "Program"]
