"""`kvguard topics`."""
