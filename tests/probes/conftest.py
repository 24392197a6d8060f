"""Fixtures of the probe tests."""

import logging

import pytest


@pytest.fixture
def debug_lines():
    """The DEBUG lines of logger ``autofit.probes`` while the test runs (whatever the CLI set up before)."""
    lines: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("autofit.probes")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)
