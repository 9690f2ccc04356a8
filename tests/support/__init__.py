"""Helpers shared by the test areas: the error budget, the engine harnesses and the
vLLM batch cases. ``REPO`` is the checkout's root."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
