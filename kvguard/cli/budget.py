"""`kvguard budget`."""
