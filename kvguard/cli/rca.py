"""`kvguard rca`."""
