"""Real test rigs: a private Tansu (Kafka-compatible) broker and a private redis-server.

Used by ``tests/conftest.py``; usable directly by any test that must stop and restart a broker
or a redis-server (``TansuBroker(...).stop()/start()`` keep the same port).
"""

from kvguard.testing.rigs.net import free_port, wait_for_port
from kvguard.testing.rigs.redis_server import RedisServer
from kvguard.testing.rigs.tansu import TansuBroker

__all__ = ["RedisServer", "TansuBroker", "free_port", "wait_for_port"]
