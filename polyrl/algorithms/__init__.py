"""polyrl.algorithms."""
