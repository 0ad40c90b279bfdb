"""`kvguard dataset`."""
