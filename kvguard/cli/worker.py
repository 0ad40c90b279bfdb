"""`kvguard worker`."""
