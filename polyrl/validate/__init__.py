"""polyrl.validate."""
