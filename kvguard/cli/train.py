"""`kvguard train`."""
