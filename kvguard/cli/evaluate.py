"""`kvguard evaluate`."""
