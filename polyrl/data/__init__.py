"""polyrl.data."""
