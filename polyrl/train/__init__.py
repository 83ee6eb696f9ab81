"""polyrl.train."""
