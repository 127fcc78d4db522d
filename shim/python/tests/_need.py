"""What a test needs that may be missing: outside CI the test is skipped
with the reason (what is missing and how to install it); under CI=true it
fails instead, so that a CI image without it cannot pass by skipping."""

import importlib
import os
import unittest
from typing import Any

CI = os.environ.get("CI", "").lower() in ("true", "1", "yes")


def missing(test: unittest.TestCase, what: str, how: str) -> None:
    """Skips test (fails it under CI) because what is missing."""
    msg = "%s is missing; %s" % (what, how)
    if CI:
        test.fail("CI=true, so not skipping: " + msg)
    test.skipTest(msg)


def module(test: unittest.TestCase, name: str, apt: str) -> Any:
    """Imports module name, or skips (fails under CI) naming the Debian
    package that has it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        missing(test, "Python module %s (%s)" % (name, e), "apt-get install %s" % apt)
