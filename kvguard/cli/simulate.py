"""`kvguard simulate`."""
