"""Fixtures of the format tests: a seeded generator for the codec round trips."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
