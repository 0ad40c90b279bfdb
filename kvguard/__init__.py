"""kvguard: predicts GPU KV-cache OOMs minutes ahead and prevents them.

The spine: event contracts, wire schemas, settings, the bus, the composition root and the CLI.
Nothing here connects or starts at import time.
"""

__version__ = "0.1.0"
