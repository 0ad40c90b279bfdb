"""`kvguard node`."""
