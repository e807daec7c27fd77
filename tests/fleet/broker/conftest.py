"""The bridged tier's fixture (tests/support/broker_tier.py) for this folder's tests."""

from tests.support.broker_tier import tier  # noqa: F401 (fixture)
