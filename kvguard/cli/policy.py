"""`kvguard policy`."""
