"""Waiting on a condition with a deadline, instead of sleeping and hoping it happened meanwhile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll `predicate` until it returns something true, and return that; an AssertionError naming
    `what` if it has not after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return value


async def async_wait_until(
    predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05
) -> T:
    """`wait_until` inside an event loop: it awaits between polls, so the loop's tasks run meanwhile."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)
    return value
