"""`kvguard metrics`."""
