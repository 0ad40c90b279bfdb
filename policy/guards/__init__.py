"""The policy's guards: small units that each own their per-node state (``base`` has the protocol,
``registry`` the one table ``PolicyEngine`` iterates)."""
