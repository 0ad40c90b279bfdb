"""Carriers for kvguard's topics: ``KafkaBus`` (kvguard.bus.kafka) and ``InprocBus``
(kvguard.bus.inproc) share the interface in ``kvguard.bus.base``; ``kvguard.bus.dlq`` decodes
records and dead-letters what cannot be decoded. Importing this package connects to nothing
and imports no Kafka client."""

from kvguard.bus.base import Bus, Delivery, Record, SendBufferFull, Subscription, publish_and_wait

__all__ = ["Bus", "Delivery", "Record", "SendBufferFull", "Subscription", "publish_and_wait"]
