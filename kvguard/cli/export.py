"""`kvguard export`."""
