"""`kvguard demo`."""
